"""Which sampled tokens the loss may use, and the distribution each was sampled from.

The engine records a token's behaviour log-probability as log softmax(logits / T) at that
token, T being the request's own temperature (SGLang's default; see `serve/engine/sampling.py`).
The trainer recomputes π_prox and π_θ the same way, at each token's T, so that for tokens the
current weights sampled π_prox = π_behav up to float noise (`behav_logprob_gap` shows it).

Some turns were not sampled from that distribution, and no temperature makes them so. Their
tokens stay in the sequence (they are context for what follows) but leave the loss, and are
counted per reason in each step's `excluded_tokens`:

- `greedy`: temperature 0. The choice was deterministic: there is no behaviour probability to
  weight, and no exploration to reinforce.
- `truncated`: top_p < 1, top_k or min_p. The token was drawn from the renormalised nucleus,
  whose probability the recorded (untruncated) log-probability is not.
- `constrained`: the first `min_new_tokens` tokens of a turn, drawn while the end tokens were
  banned (the engine renormalised over the rest).

A turn recorded without sampling parameters was sampled at SGLang's defaults (temperature 1,
no truncation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from bus import Trajectory

EXCLUSION_REASONS = ("greedy", "truncated", "constrained")
_NO_TOP_K = 1 << 30


@dataclass(frozen=True)
class TurnSampling:
    """How one turn's tokens were drawn, as far as the loss is concerned."""

    temperature: float
    excluded: str | None
    """Why the whole turn is out of the loss (one of EXCLUSION_REASONS), or None."""
    constrained: int
    """How many of its first tokens were drawn with the end tokens banned."""

    @classmethod
    def of(cls, sampling: dict[str, Any]) -> "TurnSampling":
        temperature = float(sampling.get("temperature", 1.0))
        top_k = sampling.get("top_k", -1)
        truncated = (
            float(sampling.get("top_p", 1.0)) < 1.0
            or float(sampling.get("min_p", 0.0)) > 0.0
            or (top_k not in (-1, None, "all") and int(top_k) < _NO_TOP_K)
        )
        excluded = "greedy" if temperature <= 0.0 else "truncated" if truncated else None
        return cls(temperature if temperature > 0 else 1.0, excluded, int(sampling.get("min_new_tokens", 0)))


@dataclass
class SegmentSampling:
    """Per token of one segment: the temperature to recompute at (1.0 off the mask) and the
    loss mask with excluded tokens removed."""

    temperatures: list[float]
    loss_mask: list[int]


def segment_sampling(trajectory: Trajectory, excluded: Counter[str]) -> list[SegmentSampling]:
    """One `SegmentSampling` per segment of `trajectory`; adds the excluded tokens to `excluded`.

    Turn k of `trajectory.turns` is the k-th turn span over the segments in order (that is how
    the collector stitches them), so spans find their turns even when two share a turn index.
    """
    turns = iter(trajectory.turns)
    out = []
    for segment in trajectory.segments:
        temperatures = [1.0] * len(segment.token_ids)
        mask = list(segment.loss_mask)
        for _, start, end in segment.turn_spans:
            turn = next(turns, None)
            sampling = TurnSampling.of(turn.sampling if turn is not None else {})
            temperatures[start:end] = [sampling.temperature] * (end - start)
            _exclude(mask, start, end, sampling, excluded)
        out.append(SegmentSampling(temperatures, mask))
    return out


def _exclude(mask: list[int], start: int, end: int, sampling: TurnSampling, excluded: Counter[str]) -> None:
    if sampling.excluded is not None:
        excluded[sampling.excluded] += sum(mask[start:end])
        mask[start:end] = [0] * (end - start)
        return
    stop = min(end, start + sampling.constrained)
    if stop > start:
        excluded["constrained"] += sum(mask[start:stop])
        mask[start:stop] = [0] * (stop - start)
