"""AReaL's decoupled PPO objective, per token, averaged over the loss mask.

With π_behav the policy that sampled a token (its logprob recorded by the engine), π_prox the
trainer's weights at the start of the step, π_θ the weights being optimised, u = π_θ/π_prox,
w = π_prox/π_behav and advantage Â:

    loss = − w · min(u·Â, clip(u, 1−ε, 1+ε)·Â)

Tokens whose behaviour weight w exceeds `behav_weight_cap` are masked out of the loss (AReaL's
choice; `cap_mode="clamp"` clamps w instead). Passing `prox_logp = behav_logp` gives standard
PPO/GRPO (w ≡ 1). The mean is over all loss-mask tokens of the batch (a global token mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossStats:
    clip_fraction: float
    behav_weight_mean: float
    behav_weight_max: float
    capped_fraction: float
    tokens: int


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    behav_weight_cap: float | None = None,
    cap_mode: Literal["mask", "clamp"] = "mask",
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
    per_token = -behav_weight * torch.minimum(unclipped, clipped)
    n_tokens = mask.sum()
    loss = (per_token * mask).sum() / n_tokens.clamp(min=1.0)
    with torch.no_grad():
        counted = mask.bool()
        was_clipped = (clipped < unclipped) & counted
        original = mask.bool() | capped
        weights = torch.exp(prox_logp - behav_logp)[original]
        stats = LossStats(
            clip_fraction=float(was_clipped.sum() / n_tokens.clamp(min=1.0)),
            behav_weight_mean=float(weights.mean()) if weights.numel() else 1.0,
            behav_weight_max=float(weights.max()) if weights.numel() else 1.0,
            capped_fraction=float(capped.sum() / max(int(original.sum()), 1)),
            tokens=int(n_tokens),
        )
    return loss, stats
