"""Prompts that continue the exact tokens of a session's previous turn.

An agent sends the whole conversation on every turn. Rendering it through the chat template and
tokenizing that text again need not give back the ids the model sampled (a BPE merge across the
end of the previous answer, another split of the same text), and then the next turn's prompt
does not extend the previous prompt + output: the collector has to start a new segment, and the
model is trained on a context it never saw.

So the gateway remembers, per session, the token sequences (prompt + output) of its latest main
turns and the text each stands for (the prompt's text as rendered, then the output's). When a new prompt's rendered text starts with one of those
texts, its ids are that sequence followed by the tokenization of the rest of the text only. The
text comparison keeps this exact: if the template rewrote history, or the client edited it,
nothing matches and the prompt is tokenized whole, as before.

Where the model's tokens and the client's text part, the session keeps the model's tokens and
matches on the client's text: the context the model is trained in is the one it generated.
- A turn ended by a stop string: the output ids run to the token that completed the match
  (those tokens are the model's action, like an end token, and are trained), while the client
  gets the text before it and sends only that back.
- A special token the model sampled (`<|endoftext|>` mid-answer, say): the client's text skips
  it. As the answer's last token it is the turn's end: when the template writes the same token
  after the answer, the match covers it; when it writes another (the model ended on
  `<|endoftext|>`, the template closes with `<|im_end|>`), the template's end follows the model's.
"""

from __future__ import annotations

from typing import Any

from flywheel.lru import LRU


class SessionContinuations:
    def __init__(self, tokenizer: Any, max_sessions: int, per_session: int = 8):
        self.tokenizer = tokenizer
        self.per_session = per_session
        self._sessions: LRU[str, list[tuple[str, str, list[int]]]] = LRU(max_sessions)
        """Per session: (text, the text of a special last token the client did not see, ids)."""
        self.continued = 0
        """Prompts that continued a remembered sequence."""

    def encode(self, session_id: str | None, text: str) -> list[int]:
        """Token ids for `text`, continuing the session's longest remembered sequence that it
        extends."""
        best: tuple[int, list[int]] | None = None
        for known, end, ids in self._sessions.get(session_id) or () if session_id else ():
            for matched in (known + end, known) if end else (known,):
                if text.startswith(matched):
                    if best is None or len(matched) > best[0]:
                        best = len(matched), ids
                    break
        if best is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        self.continued += 1
        return best[1] + self.tokenizer.encode(text[best[0]:], add_special_tokens=False)

    def remember(self, session_id: str, ids: list[int], text: str | None = None) -> None:
        """Keep `ids` (a turn's prompt + output) as a sequence the session's next prompt may
        extend; `text` is what they stand for in the client's words (default: their decoding,
        special tokens included)."""
        if self._sessions.capacity == 0:
            return
        end = ""
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        elif ids and not self.tokenizer.decode(ids[-1:], skip_special_tokens=True):
            end = self.tokenizer.decode(ids[-1:], skip_special_tokens=False)
        entries = self._sessions.get(session_id) or []
        entries.append((text, end, ids))
        del entries[: -self.per_session]
        self._sessions[session_id] = entries

    def forget(self, prefix: str) -> int:
        """Drop the sequences of the sessions whose ids start with `prefix` (a tenant's
        namespace; "" for all); how many sessions went."""
        gone = [session_id for session_id in self._sessions if session_id.startswith(prefix)]
        for session_id in gone:
            self._sessions.pop(session_id)
        return len(gone)
