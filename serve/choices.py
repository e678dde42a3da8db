"""One choice of a request, as it comes back from an engine: the exact output tokens, their
behaviour logprobs and weight versions, the text, and how it finished.

`Choice` accumulates a streamed choice chunk by chunk (each chunk a delta in SGLang's
`/generate` shape) or takes a whole non-streaming response at once; either way the gateway gets
what it needs both to answer the client and to record the turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per-token weight versions of a chunk's tokens: `weight_versions` spans if present, else
    `weight_version` for all of them."""
    spans = meta.get("weight_versions")
    if not spans:
        return [int(meta["weight_version"])] * n_tokens
    versions = [int(meta["weight_version"])] * n_tokens
    for span in spans:
        start, end = max(0, span["start"]), min(n_tokens, span["end"])
        versions[start:end] = [int(span["version"])] * max(0, end - start)
    return versions


@dataclass
class Choice:
    index: int
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    text: str = ""
    finish: dict[str, Any] | None = None
    """SGLang's finish_reason object; None while running (or if the client went away)."""
    prompt_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    disconnected: bool = False

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one (delta) chunk; returns its text."""
        meta = chunk["meta_info"]
        ids = chunk["output_ids"]
        if ids:
            now = time.monotonic()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        self.output_ids += ids
        self.logprobs += [entry[0] for entry in meta.get("output_token_logprobs", [])]
        self.versions += token_versions(meta, len(ids))
        if "output_top_logprobs" in meta:
            self.top_logprobs = (self.top_logprobs or []) + [
                [(entry[1], entry[0]) for entry in position] for position in meta["output_top_logprobs"]
            ]
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        self.text += chunk["text"]
        if meta.get("finish_reason"):
            self.finish = meta["finish_reason"]
        return chunk["text"]

    @classmethod
    def from_response(cls, index: int, rid: str, response: dict[str, Any]) -> "Choice":
        choice = cls(index, rid)
        choice.add(response)
        return choice

    @property
    def finish_reason(self) -> str:
        """OpenAI's name for how it finished (before tool-call parsing)."""
        return FINISH_REASONS.get((self.finish or {}).get("type", "abort"), "abort")

    @property
    def version(self) -> int | None:
        return self.versions[-1] if self.versions else None
