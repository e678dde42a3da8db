"""Which sampled tokens the loss may use, and the distribution each was sampled from.

The engine records a token's behaviour log-probability as log softmax(logits / T) at that
token, T being the request's own temperature (SGLang's default; see `flywheel/serve/engine/sampling.py`).
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
- `unreplayable_grammar`: a turn drawn under a grammar that cannot be replayed (see below).

A turn drawn under a grammar (`json_schema`, `regex`, `ebnf` or `structural_tag` in its
sampling parameters: `response_format`, a forced tool call) was sampled from the logits with the
tokens the grammar forbade masked out, from its first output token on. Its tokens stay in the
loss: the grammar is replayed over the turn's sampled ids (`flywheel/formats/grammar.py`, the engine's own
compilation, for the model's tokenizer) and each loss token keeps the bitmask of the tokens
allowed before it, so the trainer recomputes it over those tokens only (`GrammarMasks`). A turn
whose grammar does not compile, or rejects a token the engine sampled, cannot be: it leaves the
loss rather than be trained over the whole vocabulary.

A turn recorded without sampling parameters was sampled at SGLang's defaults (temperature 1,
no truncation).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.bus import Trajectory
from flywheel.formats.grammar import GrammarError, constraint, model_grammar
from flywheel.train.packing import GrammarMasks

log = logging.getLogger(__name__)

UNREPLAYABLE = "unreplayable_grammar"
EXCLUSION_REASONS = ("greedy", "truncated", "constrained", UNREPLAYABLE)
_NO_TOP_K = 1 << 30


@dataclass(frozen=True)
class TurnSampling:
    """How one turn's tokens were drawn, as far as the loss is concerned."""

    temperature: float
    excluded: str | None
    """Why the whole turn is out of the loss (one of EXCLUSION_REASONS), or None."""
    constrained: int
    """How many of its first tokens were drawn with the end tokens banned."""
    grammar: tuple[str, str] | None = None
    """The constraint its tokens were drawn under (`flywheel.formats.grammar.constraint`), or None."""

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
        try:
            grammar = constraint(sampling)
        except GrammarError:  # two constraints: no engine samples that
            grammar, excluded = None, excluded or UNREPLAYABLE
        return cls(temperature if temperature > 0 else 1.0, excluded, int(sampling.get("min_new_tokens", 0)), grammar)


@dataclass
class SegmentSampling:
    """Per token of one segment: the temperature to recompute at (1.0 off the mask) and the
    loss mask with excluded tokens removed; and the loss tokens drawn under a grammar."""

    temperatures: list[float]
    loss_mask: list[int]
    grammar: GrammarMasks | None = None


def segment_sampling(trajectory: Trajectory, excluded: Counter[str], model: str | Path | None = None) -> list[SegmentSampling]:
    """One `SegmentSampling` per segment of `trajectory`; adds the excluded tokens to `excluded`.

    Turn k of `trajectory.turns` is the k-th turn span over the segments in order (that is how
    the collector stitches them), so spans find their turns even when two share a turn index.
    Grammars are replayed for the tokenizer of `model` (a `models.resolve_model` spec); without
    one, a turn drawn under a grammar cannot be replayed.
    """
    turns = iter(trajectory.turns)
    out = []
    for segment in trajectory.segments:
        temperatures = [1.0] * len(segment.token_ids)
        mask = list(segment.loss_mask)
        positions: list[int] = []
        allowed: list[torch.Tensor] = []
        for _, start, end in segment.turn_spans:
            turn = next(turns, None)
            sampling = TurnSampling.of(turn.sampling if turn is not None else {})
            temperatures[start:end] = [sampling.temperature] * (end - start)
            _exclude(mask, start, end, sampling, excluded)
            if sampling.grammar is None or not any(mask[start:end]):
                continue
            bitmask = _replay(model, sampling.grammar, segment.token_ids[start:end])
            if bitmask is None:
                excluded[UNREPLAYABLE] += sum(mask[start:end])
                mask[start:end] = [0] * (end - start)
                continue
            kept = [i for i in range(end - start) if mask[start + i]]
            positions += [start + i for i in kept]
            allowed.append(bitmask[kept])
        out.append(SegmentSampling(temperatures, mask, GrammarMasks(positions, torch.cat(allowed)) if allowed else None))
    return out


def _replay(model: str | Path | None, grammar: tuple[str, str], token_ids: Any) -> torch.Tensor | None:
    """The bitmasks each of `token_ids` was drawn under, or None if they cannot be replayed."""
    if model is None:
        return None
    try:
        return model_grammar(model).replay(*grammar, list(token_ids))
    except Exception as exc:  # GrammarError, or llguidance failing: never train over the whole vocabulary
        log.warning("a turn's %s cannot be replayed, its tokens leave the loss: %s", grammar[0], exc)
        return None


def _exclude(mask: list[int], start: int, end: int, sampling: TurnSampling, excluded: Counter[str]) -> None:
    if sampling.excluded is not None:
        excluded[sampling.excluded] += sum(mask[start:end])
        mask[start:end] = [0] * (end - start)
        return
    stop = min(end, start + sampling.constrained)
    if stop > start:
        excluded["constrained"] += sum(mask[start:stop])
        mask[start:stop] = [0] * (stop - start)
