"""Session continuations: a prompt that extends a session's previous turn reuses the exact ids the
model saw and sampled, even where tokenizing the text again would give other ids."""

from transformers import AutoTokenizer

from flywheel.models import resolve_model
from flywheel.serve.continuation import SessionContinuations


def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def test_the_next_prompt_continues_the_sampled_ids_not_a_retokenization():
    tok = tokenizer()
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    whole = tok.encode(" the", add_special_tokens=False)
    pieces = tok.encode(" ", add_special_tokens=False) + tok.encode("the", add_special_tokens=False)
    assert len(whole) == 1 and pieces != whole  # the model sampled " " + "t" + "he": text that tokenizes otherwise
    continuations = SessionContinuations(tok, max_sessions=10)
    continuations.remember("s", prompt + pieces)
    text = tok.decode(prompt + pieces) + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    ids = continuations.encode("s", text)
    assert ids[: len(prompt) + len(pieces)] == prompt + pieces and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False)[: len(prompt) + len(pieces)] != prompt + pieces
    assert continuations.continued == 1


def test_edited_history_other_sessions_and_eviction_fall_back_to_plain_tokenization():
    tok = tokenizer()
    continuations = SessionContinuations(tok, max_sessions=1)
    sampled = tok.encode("a", add_special_tokens=False) + tok.encode("b", add_special_tokens=False)
    continuations.remember("s", sampled)
    assert continuations.encode("s", "xab") == tok.encode("xab", add_special_tokens=False)  # no prefix match
    assert continuations.encode("other", "abc") == tok.encode("abc", add_special_tokens=False)
    assert continuations.encode(None, "abc") == tok.encode("abc", add_special_tokens=False)
    continuations.remember("t", sampled)  # evicts "s"
    assert continuations.encode("s", "abc") == tok.encode("abc", add_special_tokens=False)
    assert continuations.encode("t", "abc")[:2] == sampled
    assert SessionContinuations(tok, max_sessions=0).encode("t", "abc") == tok.encode("abc", add_special_tokens=False)
