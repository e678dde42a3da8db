"""AReaL's decoupled PPO objective, per token, averaged over the loss mask.

With π_behav the policy that sampled a token (its logprob recorded by the engine), π_prox the
trainer's weights at the start of the step, π_θ the weights being optimised, u = π_θ/π_prox,
w = π_prox/π_behav and advantage Â:

    loss = − w · min(u·Â, clip(u, 1−ε, 1+ε)·Â)

Tokens whose behaviour weight w exceeds `behav_weight_cap` are masked out of the loss (AReaL's
choice; `cap_mode="clamp"` clamps w instead). With `dual_clip` c, a token with Â < 0 has its
objective bounded below by c·Â: loss = − w · max(min(u·Â, clip(u)·Â), c·Â). Passing
`prox_logp = behav_logp` gives standard PPO/GRPO (w ≡ 1).

The loss is a token mean: the sum over counted tokens divided by `denominator`, by default the
number of counted tokens here. A step split into micro-batches passes the whole step's count, so
the accumulated gradient is that of one global token mean.

With `actor.kl_coef` β > 0 the trainer adds β · `k3_kl` to it: Schulman's k3 estimator of
KL(π_θ ‖ π_ref) to a frozen reference policy, r − log r − 1 with r = π_ref/π_θ per token
(unbiased, always ≥ 0), under the same mask and denominator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossStats:
    """Counts over one loss computation; `merge` adds those of several micro-batches."""

    tokens: int
    """Tokens that counted in the loss (on the mask, not capped away)."""
    clipped: int
    """Counted tokens whose clipped term was the smaller one (no gradient through u)."""
    candidates: int
    """Tokens on the loss mask before the cap."""
    capped: int
    """Candidates whose behaviour weight exceeded the cap."""
    behav_weight_sum: float
    behav_weight_max: float

    def merge(self, other: "LossStats") -> "LossStats":
        return LossStats(
            self.tokens + other.tokens, self.clipped + other.clipped, self.candidates + other.candidates,
            self.capped + other.capped, self.behav_weight_sum + other.behav_weight_sum,
            max(self.behav_weight_max, other.behav_weight_max),
        )

    @property
    def clip_fraction(self) -> float:
        return self.clipped / max(self.tokens, 1)

    @property
    def capped_fraction(self) -> float:
        return self.capped / max(self.candidates, 1)

    @property
    def behav_weight_mean(self) -> float:
        return self.behav_weight_sum / self.candidates if self.candidates else 1.0


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    behav_weight_cap: float | None = None,
    cap_mode: Literal["mask", "clamp"] = "mask",
    dual_clip: float | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """All tensors have the same shape; `mask` is 1 on tokens that count. Returns (loss, stats)."""
    mask = mask.to(logp.dtype)
    prox_logp = prox_logp.detach()
    behav_weight = torch.exp(prox_logp - behav_logp.detach())
    capped = torch.zeros_like(mask, dtype=torch.bool)
    if behav_weight_cap is not None:
        capped = (behav_weight > behav_weight_cap) & mask.bool()
        if cap_mode == "mask":
            mask = mask * (~capped).to(mask.dtype)
        else:
            behav_weight = behav_weight.clamp(max=behav_weight_cap)
    ratio = torch.exp(logp - prox_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    per_token = -behav_weight * objective
    n_tokens = mask.sum()
    loss = (per_token * mask).sum() / (n_tokens.clamp(min=1.0) if denominator is None else max(denominator, 1.0))
    with torch.no_grad():
        counted = mask.bool()
        was_clipped = (clipped < unclipped) & counted
        original = mask.bool() | capped
        weights = torch.exp(prox_logp - behav_logp)[original]
        stats = LossStats(
            tokens=int(n_tokens),
            clipped=int(was_clipped.sum()),
            candidates=int(original.sum()),
            capped=int(capped.sum()),
            behav_weight_sum=float(weights.sum()),
            behav_weight_max=float(weights.max()) if weights.numel() else 1.0,
        )
    return loss, stats


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, denominator: float) -> torch.Tensor:
    """The k3 estimate of KL(π_θ ‖ π_ref), summed over `mask` and divided by `denominator`
    (the same token mean as the loss); gradients flow through `logp` only."""
    log_ratio = ref_logp.detach() - logp
    return ((log_ratio.exp() - log_ratio - 1.0) * mask).sum() / max(denominator, 1.0)
