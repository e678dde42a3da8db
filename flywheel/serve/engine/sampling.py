"""Per-request sampling parameters (SGLang's `sampling_params`) and the batched sampler.

The behaviour log-probability recorded for a token is log softmax(logits / temperature) at that
token: the distribution the token was drawn from before top-p/top-k truncation, which is what
the trainer recomputes with `actor.temperature` equal to the rollout temperature. With
temperature 0 (greedy) it is the plain log softmax.

Sampling is safe for any valid parameters: the top-p nucleus is computed in float64 (a top_p as
small as 1e-300 does not underflow) and always keeps the most likely token. A row whose
distribution is still not finite (a temperature so small that logits / temperature overflow, or
a model that produced NaN) is reported as failed; the other rows are sampled as usual.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

TOP_K_ALL = 1 << 30  # SGLang's "no top-k" value
SEED_RANGE = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64) (and negatives down to -2**63)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The subset of SGLang's `SamplingParams` the embedded engine implements."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_new_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    """Any integer; taken modulo 2**64 (the seeds a `torch.Generator` holds), so seeds that differ
    by a multiple of 2**64 draw the same tokens."""
    top_logprobs_num: int = 0
    """Also return this many most likely tokens (with logprobs) at each output position."""
    logprob_start_len: int = -1
    """Also return input token log-probabilities from this position (SGLang's top-level field,
    carried here with `return_logprob`; -1: none; `flywheel/serve/engine/input_logprobs.py`)."""
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    """At most one constraint on the output (`flywheel.serve.engine.grammar`)."""

    def validate(self) -> None:
        """Raise ValueError naming the parameter if a value is out of range."""
        if self.max_new_tokens < 0:
            raise ValueError("sampling_params.max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("sampling_params.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling_params.top_p must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.top_k < 1:
            raise ValueError("sampling_params.top_k must be >= 1 or -1")
        if self.min_new_tokens < 0:
            raise ValueError("sampling_params.min_new_tokens must be >= 0")
        if not 0 <= self.top_logprobs_num <= 20:
            raise ValueError("top_logprobs_num must be between 0 and 20")
        if self.logprob_start_len < -1:
            raise ValueError("logprob_start_len must be >= -1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "SamplingParams":
        raw = dict(raw or {})
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        if raw.get("stop") is None:
            raw.pop("stop", None)
        if raw.get("stop_token_ids") is None:
            raw.pop("stop_token_ids", None)
        if raw.get("top_k") == "all":
            raw["top_k"] = TOP_K_ALL
        params = msgspec.convert(raw, cls)
        params.validate()
        return params


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    top_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]]] | None, list[int]]:
    """Draw one token per row of `logits` [B, V]. Returns token ids [B], their behaviour
    logprobs [B], when `top_n` > 0 each row's `top_n` most likely (id, logprob) pairs, and the
    rows whose distribution is not finite (nothing was drawn for them: their token and logprob
    are meaningless)."""
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)

    probs = torch.softmax(_truncate(scaled, params), dim=-1)
    finite = torch.isfinite(probs).all(dim=-1)
    failed = (~finite).nonzero().squeeze(1).tolist()
    tokens = _draw(probs, generators)
    if greedy.any():
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = None
    if top_n > 0:
        values, indices = logprobs.topk(top_n, dim=-1)
        top = [list(zip(row_ids, row_lps)) for row_ids, row_lps in zip(indices.tolist(), values.tolist())]
    return tokens, chosen, top, failed


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [B, V] by inverting its cumulative distribution at a uniform
    draw: a seeded row's uniform comes from its own generator, the others' from torch's global
    one. One batched cumulative sum (in float64) for every row, instead of a `multinomial` call
    per seeded row (each a pass over the vocabulary: 13 % of the engine's time at 32 seeded
    streams). A token of probability 0 is never drawn; rows that are not finite draw garbage."""
    uniform = torch.rand(len(probs), dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = probs.double().cumsum(-1)
    targets = uniform.to(probs.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    landed = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) > 0
    if not bool(landed.all()):  # a target rounded onto the total: the last token with mass
        last = probs.shape[1] - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(-1)
        tokens = torch.where(landed, tokens, last)
    return tokens


def _truncate(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply each row's top-k and top-p by setting excluded logits to -inf. The most likely token
    is always kept; the top-p mass is summed in float64, where no top_p in (0, 1] underflows."""
    need_k = [p.top_k < scaled.shape[1] for p in params]
    need_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if not any(need_k) and not need_p:
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    top_k = torch.tensor([min(p.top_k, scaled.shape[1]) for p in params], device=scaled.device).unsqueeze(1)
    drop = ranks >= top_k
    if need_p:
        top_p = torch.tensor([params[i].top_p for i in need_p], dtype=torch.float64, device=scaled.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits[need_p].double(), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the more likely
        # ones already hold top_p.
        drop[need_p] |= (probs.cumsum(dim=-1) - probs) >= top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
