"""The embedded engine on the real tiny model: exact logprobs, batching, sampling controls,
weight updates between batches, and SGLang's native response shape."""

import asyncio

import pytest
import torch

from flywheel.models import WeightStore, load_model
from flywheel.serve.engine import (
    Engine,
    ProtocolError,
    SamplingParams,
    generate,
    version_spans,
)

from factories import prompt, recomputed_logprobs
from waiting import until


@pytest.fixture
def engine(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    from flywheel.models import load_weights

    eng = Engine(model, tokenizer, max_batch_size=8, load_weights=load_weights).start()
    yield eng
    eng.stop()


async def test_behaviour_logprobs_match_a_full_forward_pass(engine, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ids = prompt(tokenizer, "Reply with a number.")
    for temperature in (1.0, 0.7):
        result = await engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=temperature, sampling_seed=3))
        assert result.prompt_ids == ids and len(result.output_ids) == len(result.logprobs) > 0
        expected = recomputed_logprobs(model, ids, result.output_ids, temperature)
        assert result.logprobs == pytest.approx(expected, abs=2e-4)
        assert result.versions == ["0"] * len(result.output_ids)


async def test_batched_rows_of_different_lengths_decode_like_single_requests(engine, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    texts = ["hi", "What is 12 + 7? Answer with the number only.", "Write some digits, please, many of them."]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [await engine.generate(prompt(tokenizer, t), greedy) for t in texts]
    steps = engine.stats["steps"]
    together = await asyncio.gather(*(engine.generate(prompt(tokenizer, t), greedy) for t in texts))
    assert engine.stats["steps"] - steps < sum(len(r.output_ids) for r in together)  # decoded together
    for a, b in zip(alone, together):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


async def test_requests_join_and_leave_a_running_batch(engine, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    long_ids, short_ids = prompt(tokenizer, "Give me a long number."), prompt(tokenizer, "hi there")
    long_params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    long_alone = await engine.generate(long_ids, long_params)
    short_alone = await engine.generate(short_ids, short_params)
    stream = engine.stream(long_ids, long_params)
    seen = 0
    async for item in stream:  # let the long one run a few steps, then add the short one
        seen += 1
        if seen == 10:
            short_task = asyncio.ensure_future(engine.generate(short_ids, short_params))
            await until(lambda: engine.load()["num_running_reqs"] >= 2 or short_task.done(), poll_s=0.001)
    long_joined = item
    short_joined = await short_task
    assert long_joined.output_ids == long_alone.output_ids
    assert short_joined.output_ids == short_alone.output_ids
    assert long_joined.logprobs == pytest.approx(long_alone.logprobs, abs=1e-4)
    assert short_joined.logprobs == pytest.approx(short_alone.logprobs, abs=1e-4)


async def test_seeds_reproduce_and_differ(engine, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    ids = prompt(tokenizer, "Write some digits.")
    params = lambda seed: SamplingParams(max_new_tokens=16, sampling_seed=seed, ignore_eos=True)  # noqa: E731
    a, b, c = await asyncio.gather(*(engine.generate(ids, params(s)) for s in (1, 1, 2)))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


async def test_stop_conditions(engine, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    ids = prompt(tokenizer, "hello")
    first = await engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert first.finish_reason == {"type": "length", "length": 8}
    stop_id = first.output_ids[2]
    by_id = await engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[stop_id]))
    assert by_id.output_ids == first.output_ids[: first.output_ids.index(stop_id) + 1]
    assert by_id.finish_reason == {"type": "stop", "matched": stop_id}
    piece = tokenizer.decode(first.output_ids[3:5])
    if piece.strip():
        by_text = await engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0, stop=[piece], ignore_eos=True))
        assert by_text.finish_reason == {"type": "stop", "matched": piece}
        assert piece not in by_text.text and first.text.startswith(by_text.text)
    eos = tokenizer.eos_token_id
    forced = await engine.generate(ids, SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0, stop_token_ids=[stop_id]))
    assert stop_id not in forced.output_ids[:5] and eos not in forced.output_ids[:5]
    empty = await engine.generate(ids, SamplingParams(max_new_tokens=0))
    assert empty.output_ids == [] and empty.finish_reason["type"] == "length"


async def test_prompts_beyond_the_context_window_are_refused(engine):
    with pytest.raises(ValueError, match="context window"):
        await engine.generate([5] * engine.context_length, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], SamplingParams())


async def test_weight_update_applies_between_batches_and_labels_tokens(engine, model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    original = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, _ = load_model("tiny")
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    store = WeightStore(tmp_path / "weights")
    path = store.publish(fresh, 5)
    ids = prompt(tokenizer, "Reply with a number.")
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    before = await engine.generate(ids, greedy)
    try:
        await engine.update_weights(str(path), "5")
        after = await engine.generate(ids, greedy)
        assert engine.version == "5" and after.versions == ["5"] * 10
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)
        assert after.logprobs == pytest.approx(recomputed_logprobs(model, ids, after.output_ids), abs=2e-4)  # every step's
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight) or not model.config.tie_word_embeddings
    finally:
        model.load_state_dict(original)
        engine.version = "0"
    with pytest.raises(Exception):
        await engine.update_weights(str(tmp_path / "missing"), "6")
    assert engine.version == "0"


async def test_native_generate_speaks_sglang(engine, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    ids = prompt(tokenizer, "hi")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "rid": "r1", "return_prompt_token_ids": True}
    out = await generate(engine, body)
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == "0" and "weight_versions" not in meta
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    assert out["prompt_token_ids"] == ids and isinstance(out["text"], str)
    batch = await generate(engine, {"text": ["hi", "yo"], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(batch, list) and len(batch) == 2 and "output_token_logprobs" not in batch[0]["meta_info"]


@pytest.mark.parametrize("body, message", [
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": [10**9]}, "token ids"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "sampling_params"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1] * 70_000}, "context window"),
])
async def test_native_generate_rejects_bad_requests(engine, body, message):
    with pytest.raises(ProtocolError, match=message):
        await generate(engine, body)


def test_version_spans():
    assert version_spans(["3", "3", "4", "4", "4"]) == [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert version_spans(["default", "heldout-7"]) == [{"version": "default", "start": 0, "end": 1},
                                                       {"version": "heldout-7", "start": 1, "end": 2}]
    assert version_spans([]) == []
