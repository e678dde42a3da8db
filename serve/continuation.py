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

A turn ended by a stop string is the one case where the model's tokens and the client's text
part: the output ids run to the token that completed the match (those tokens are the model's
action, like an end token, and are trained), while the client gets the text before it and sends
only that back. Such a turn is remembered with the text the client saw, so the next prompt
continues the recorded ids, stop tokens included, and the session stays one segment: the
context the model is trained in is the one it generated.
"""

from __future__ import annotations

from typing import Any

from bus.lru import LRU


class SessionContinuations:
    def __init__(self, tokenizer: Any, max_sessions: int, per_session: int = 8):
        self.tokenizer = tokenizer
        self.per_session = per_session
        self._sessions: LRU[str, list[tuple[str, list[int]]]] = LRU(max_sessions)
        self.continued = 0
        """Prompts that continued a remembered sequence."""

    def encode(self, session_id: str | None, text: str) -> list[int]:
        """Token ids for `text`, continuing the session's longest remembered sequence that it
        extends."""
        best: tuple[str, list[int]] | None = None
        for known_text, ids in self._sessions.get(session_id) or () if session_id else ():
            if text.startswith(known_text) and (best is None or len(known_text) > len(best[0])):
                best = known_text, ids
        if best is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        self.continued += 1
        return best[1] + self.tokenizer.encode(text[len(best[0]):], add_special_tokens=False)

    def remember(self, session_id: str, ids: list[int], text: str | None = None) -> None:
        """Keep `ids` (a turn's prompt + output) as a sequence the session's next prompt may
        extend; `text` is what they stand for in the client's words (default: their decoding;
        they differ when earlier stop tokens are in the ids but not in the client's text)."""
        if self._sessions.capacity == 0:
            return
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        entries = self._sessions.get(session_id) or []
        entries.append((text, ids))
        del entries[: -self.per_session]
        self._sessions[session_id] = entries
