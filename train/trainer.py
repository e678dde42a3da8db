"""One optimizer step of decoupled PPO over a step's micro-batches.

Log-probabilities are computed the way the engine sampled: log softmax(logits / temperature) at
the exact token ids, position t predicted from position t − 1. A step:

1. for each micro-batch, π_prox's logprobs in one no-grad pass (when the loss is decoupled; the
   weights do not change until the optimizer step, so this is the policy at the step's start),
   then the loss with gradients, divided by the step's total count of loss tokens so that the
   accumulated gradient is that of one token mean over the whole step; with `actor.kl_coef`, a
   k3 KL penalty to the frozen reference policy is added per token;
2. gradient clipping to `actor.optimizer.max_grad_norm`, one AdamW step, one schedule step.

On CUDA the forward passes run under bf16 autocast (the weights and the optimizer stay fp32).
`train.fsdp` shards the model over a process group (`train/fsdp.py`).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from config.schema import ActorConfig, TrainConfig
from train.batch import MicroBatch
from train.fsdp import shard
from train.loss import LossStats, decoupled_ppo_loss
from train.schedule import make_scheduler


class Trainer:
    def __init__(self, model: torch.nn.Module, actor: ActorConfig, train: TrainConfig):
        self.actor = actor
        self.device = torch.device(train.device)
        self.model = model.to(self.device)
        if train.fsdp:
            self.model = shard(self.model)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if actor.kl_coef > 0 else None
        opt = actor.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, opt, train.max_steps)
        self.step_count = 0

    def _autocast(self) -> Any:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def token_logprobs(self, batch: MicroBatch, model: torch.nn.Module | None = None,
                       with_entropy: bool = False) -> tuple[torch.Tensor, float | None]:
        """(logprob of each token given its prefix, 0 at position 0; the summed entropy of the
        predictions of loss-mask tokens, or None)."""
        with self._autocast():
            logits = (model or self.model)(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False,
            ).logits
        logits = logits[:, :-1].float() / self.actor.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(2, batch.input_ids[:, 1:].unsqueeze(2)).squeeze(2)
        entropy = None
        if with_entropy:  # only where it is reported: over the vocabulary, it is not cheap
            with torch.no_grad():
                counted = logp_all[batch.loss_mask[:, 1:].bool()]
                entropy = float(-(counted.exp() * counted).sum())
        pad = torch.zeros((logp.shape[0], 1), dtype=logp.dtype, device=logp.device)
        return torch.cat([pad, logp], dim=1), entropy

    def _to_device(self, batch: MicroBatch) -> MicroBatch:
        if self.device.type == "cpu":
            return batch
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
        return MicroBatch(**moved)

    def step(self, batches: list[MicroBatch]) -> dict[str, Any]:
        started = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = float(sum(b.loss_mask.sum() for b in batches))
        stats: LossStats | None = None
        loss_sum = kl_sum = entropy_sum = 0.0
        for batch in map(self._to_device, batches):
            if self.actor.use_decoupled_loss:
                with torch.no_grad():
                    prox_logp, _ = self.token_logprobs(batch)
            else:
                prox_logp = batch.behav_logp
            logp, entropy = self.token_logprobs(batch, with_entropy=True)
            loss, part = decoupled_ppo_loss(
                logp, prox_logp, batch.behav_logp, batch.advantages, batch.loss_mask, self.actor.eps_clip,
                self.actor.behav_imp_weight_cap, self.actor.behav_imp_weight_cap_mode, self.actor.dual_clip, denominator=total,
            )
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp, _ = self.token_logprobs(batch, self.reference)
                log_ratio = ref_logp - logp
                kl = ((log_ratio.exp() - log_ratio - 1.0) * batch.loss_mask).sum() / max(total, 1.0)
                loss = loss + self.actor.kl_coef * kl
                kl_sum += float(kl.detach())
            loss.backward()
            loss_sum += float(loss.detach())
            entropy_sum += entropy
            stats = part if stats is None else stats.merge(part)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.actor.optimizer.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        assert stats is not None
        computed = sum(b.computed_tokens for b in batches)
        elapsed = time.perf_counter() - started
        return {
            "loss": loss_sum,
            "kl": kl_sum if self.reference is not None else None,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "lr": lr,
            "entropy": entropy_sum / max(total, 1.0),
            "clip_fraction": stats.clip_fraction,
            "behav_weight_mean": stats.behav_weight_mean,
            "behav_weight_max": stats.behav_weight_max,
            "capped_fraction": stats.capped_fraction,
            "tokens": stats.tokens,
            "real_tokens": sum(b.real_tokens for b in batches),
            "computed_tokens": computed,
            "micro_batches": len(batches),
            "step_s": elapsed,
            "tokens_per_s": computed / elapsed if elapsed > 0 else None,
        }

    def state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step_count}

    def restore(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
