"""One policy-gradient step on a `TokenBatch` with the decoupled PPO objective.

Log-probabilities are computed the way the engine sampled: log softmax(logits / temperature)
at the exact token ids, position t predicted from position t-1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from config.schema import ActorConfig
from train.batch import TokenBatch
from train.loss import decoupled_ppo_loss


class Trainer:
    def __init__(self, model: torch.nn.Module, actor: ActorConfig):
        self.model = model
        self.actor = actor
        opt = actor.optimizer
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.step_count = 0

    def token_logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob of each token given its prefix, entropy of that prediction); position 0 is 0."""
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1].float() / self.actor.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(2, batch.input_ids[:, 1:].unsqueeze(2)).squeeze(2)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        pad = torch.zeros((logp.shape[0], 1), dtype=logp.dtype)
        return torch.cat([pad, logp], dim=1), torch.cat([pad, entropy], dim=1)

    def step(self, batch: TokenBatch) -> dict[str, Any]:
        self.model.train()
        if self.actor.use_decoupled_loss:
            with torch.no_grad():
                prox_logp, _ = self.token_logprobs(batch)
        else:
            prox_logp = batch.behav_logp
        logp, entropy = self.token_logprobs(batch)
        loss, stats = decoupled_ppo_loss(
            logp,
            prox_logp,
            batch.behav_logp,
            batch.advantages,
            batch.loss_mask,
            self.actor.eps_clip,
            self.actor.behav_imp_weight_cap,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.actor.optimizer.max_grad_norm)
        self.optimizer.step()
        self.step_count += 1
        mask = batch.loss_mask
        return {
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm) if math.isfinite(float(grad_norm)) else None,
            "entropy": float((entropy * mask).sum() / mask.sum().clamp(min=1)),
            "clip_fraction": stats.clip_fraction,
            "behav_weight_mean": stats.behav_weight_mean,
            "behav_weight_max": stats.behav_weight_max,
            "capped_fraction": stats.capped_fraction,
            "tokens": stats.tokens,
        }
