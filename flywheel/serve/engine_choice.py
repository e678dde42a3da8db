"""One choice of a request, as it comes back from an engine: the exact output tokens, their
behaviour logprobs and weight versions, the text, and how it finished.

`Choice` accumulates a streamed choice chunk by chunk (each chunk a delta in SGLang's
`/generate` shape) or takes a whole non-streaming response at once; either way the gateway gets
what it needs both to answer the client and to record the turn.

**Version labels.** An engine names its weights with an opaque string (SGLang: `--weight-version`,
"default" unless given; a weight update may set any label). Flywheel's versions are integers
and its trainer labels weights `str(N)`. One rule, `version_of`, turns a label into a version:
a non-negative decimal integer (below 2**31, what records hold) is that version; any other
label ("default", "heldout-7") is version 0, the weights the engine started with: the oldest
possible, so staleness computed from it is never under-estimated. A token sampled with a LoRA
adapter is labelled `<adapter>@<label>` (the embedded engine's way; the gateway loads version N of
an adapter with the label `str(N)`): its version is the label's, that adapter's own integer
version (`alice@3` is 3; the turn names the adapter, `Turn.adapter`).

**Adapters on engines that do not label them.** A server that reports its base weights' label
for an adapter's tokens too (SGLang, vLLM) says nothing of the adapter's version: the HTTP
clients label such tokens with the adapter version they loaded into that engine before the
request began (`bound_versions`' `adapter`), never newer than the one that sampled them.

**Which version sampled a token.** Where a chunk (or whole response) carries `weight_versions`
spans, they say so exactly (SGLang 0.5.23 reports them once a request's weights changed in
flight; so does the embedded engine). Without spans, `weight_version` is only the engine's label
when the chunk was produced: tokens sampled before a swap would look newer than they are. The
HTTP client (`flywheel.serve.backends.sglang`) then applies `bound_versions`: a chunk's tokens get the older
of the version the gateway knew for that engine when those tokens began (at the request's start
for the first chunk, the previous chunk's version for a later one) and the version the chunk
reports. The gateway knows an engine's version because it drives the swaps: it learns the new
one when `/update_weights_from_disk` returns, after the engine loaded it. Tokens are therefore
never labelled newer than the weights that sampled them (staleness is never under-estimated);
what it costs is that tokens of a chunk that straddles a swap, and a whole non-streamed answer
that does, count as the older version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flywheel.serve.text_pieces import TextPieces

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
MAX_VERSION = 2**31 - 1


def version_of(label: Any) -> int:
    """Flywheel's version for an engine's weight version label: a non-negative decimal integer
    (up to `MAX_VERSION`) is that version, any other label 0; an adapter's `<name>@<label>` is
    its label's version."""
    text = str(label) if type(label) is int else label
    if isinstance(text, str) and "@" in text:
        text = text.rpartition("@")[2]
    if isinstance(text, str) and len(text) <= 10 and text.isascii() and text.isdecimal() and int(text) <= MAX_VERSION:
        return int(text)
    return 0


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per-token weight versions of a chunk's tokens: `weight_versions` spans if present, else
    `weight_version` for all of them."""
    versions = [version_of(meta.get("weight_version"))] * n_tokens
    for span in meta.get("weight_versions") or []:
        start, end = max(0, span["start"]), min(n_tokens, span["end"])
        versions[start:end] = [version_of(span["version"])] * max(0, end - start)
    return versions


def labels_adapter(label: Any, adapter: str) -> bool:
    """Whether an engine's label names a version of `adapter` (`<adapter>@<label>`)."""
    return isinstance(label, str) and label.startswith(f"{adapter}@")


def bound_versions(meta: dict[str, Any], n_tokens: int, known: int, adapter: str | None = None) -> int:
    """For a chunk of `n_tokens` tokens without spans, the rule above: label them all
    min(`known`, the version the chunk reports), written as one span. `known` is the version
    the gateway knew for the engine when these tokens began; returns the one the next chunk's
    tokens begin from (what this chunk reports).

    With `adapter` (the request's `lora_path`), versions are that adapter's and `known` the
    adapter version the client had loaded into the engine: labels that do not name the adapter
    (the engine's base label, spans of them included) say nothing of it and are dropped, and the
    chunk's tokens are `known`."""
    label = meta.get("weight_version")
    if adapter is not None and not labels_adapter(label, adapter):
        reported = known
        if any(not labels_adapter(span.get("version"), adapter) for span in meta.get("weight_versions") or []):
            del meta["weight_versions"]
    else:
        reported = version_of(label)
    if n_tokens and not meta.get("weight_versions"):
        meta["weight_versions"] = [{"version": str(min(known, reported)), "start": 0, "end": n_tokens}]
    return reported


@dataclass
class Choice:
    index: int
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    pieces: TextPieces = field(default_factory=TextPieces)
    """The output's text as it came, chunk by chunk (`text` joins it)."""
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
        self.pieces.append(chunk["text"])
        if meta.get("finish_reason"):
            self.finish = meta["finish_reason"]
        return chunk["text"]

    @classmethod
    def from_response(cls, index: int, rid: str, response: dict[str, Any]) -> "Choice":
        choice = cls(index, rid)
        choice.add(response)
        return choice

    @property
    def text(self) -> str:
        return self.pieces.text

    @property
    def finish_reason(self) -> str:
        """OpenAI's name for how it finished (before tool-call parsing)."""
        return FINISH_REASONS.get((self.finish or {}).get("type", "abort"), "abort")

    @property
    def version(self) -> int | None:
        return self.versions[-1] if self.versions else None
