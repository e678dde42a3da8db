"""One training step of decoupled PPO: π_prox recomputed once, then several optimizer steps.

Log-probabilities are computed the way the engine sampled: log softmax(logits / T) at the exact
token ids, position t predicted from position t − 1, T being each token's own sampling
temperature (`flywheel/train/trainable_tokens.py`); a token drawn under a grammar, over the tokens the grammar
allowed there only (`MicroBatch.grammar_at`: those positions' logits are gathered and the
forbidden ones set to −inf), and its entropy is that of this masked distribution too. Every forward pass (π_prox, π_θ, the KL
reference) runs in eval mode, as the engine's: dropout off (gradients flow all the same), so
π_θ = π_prox on the first minibatch and π_prox = π_behav for the current version's tokens
whatever the model's dropout settings. A step takes the batch as `actor.ppo_n_minibatches`
minibatches, each a list of micro-batches:

1. π_prox: one no-grad pass over every micro-batch at the step's start (when
   `actor.recompute_logprobs`), so every minibatch is weighed against the same proximal
   policy. `behav_logprob_gap`, the mean |log π_prox − log π_behav| over the tokens the current
   version sampled, shows that the recomputation reproduces the engine (≈ 0 up to float noise).
2. per minibatch: the loss with gradients, accumulated over its micro-batches and divided by the
   minibatch's count of loss tokens (one token mean per minibatch); with `actor.kl_coef`, the k3
   KL penalty to the frozen reference policy (`flywheel/train/loss.py`); then gradient clipping to
   `actor.optimizer.max_grad_norm` and one AdamW step. From the second minibatch on π_θ ≠ π_prox,
   so the PPO clip is a real trust region (`clip_fraction`). With `actor.ppo_epochs` n, the
   minibatches n times over, every pass against the same π_prox.
3. one learning-rate schedule step per training step.

With `adapters.kind: lora` the base is frozen and the step trains LoRA adapters
(`flywheel/train/adapters.py`): each micro-batch is one adapter's, and its forward passes (π_prox,
π_θ) run with that adapter active; the KL reference is the base with every adapter disabled. Each
minibatch's loss is a token mean per adapter, and each adapter the minibatch holds clips its own
gradient and takes its own AdamW step; each adapter takes its own schedule step per training step.
`version` is then each adapter's version (`behav_logprob_gap` compares an adapter's own tokens).
The adapters must exist (`AdapterSet.ensure`, which the train loop calls with each new adapter's origin).

On CUDA the forward passes run under bf16 autocast unless `train.autocast` is false (the weights
and the optimizer stay fp32).
`train.fsdp` shards the model over a process group (`flywheel/train/fsdp.py`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flywheel.config.actor import ActorConfig
from flywheel.config.adapters import AdaptersConfig
from flywheel.config.schema import TrainConfig
from flywheel.formats.grammar import allowed_tokens
from flywheel.train.distill import DenseStats, DistillStats, add_distillation, topk_kl
from flywheel.train.fsdp import shard
from flywheel.train.loss import LossStats, decoupled_ppo_loss, k3_kl
from flywheel.train.packing import MicroBatch
from flywheel.train.schedule import make_scheduler

if TYPE_CHECKING:
    from flywheel.train.adapters import AdapterSet


class GapStats:
    """|log π_prox − log π_behav| over the loss tokens that `version` itself sampled."""

    def __init__(self) -> None:
        self.total = 0.0
        self.max: float | None = None
        self.tokens = 0

    def add(self, prox_logp: torch.Tensor, batch: MicroBatch, version: int | None) -> None:
        if version is None:
            return
        own = batch.loss_mask.bool() & (batch.versions == version)
        diff = (prox_logp - batch.behav_logp)[own].abs()
        if diff.numel():
            self.total += float(diff.sum())
            self.max = max(self.max or 0.0, float(diff.max()))
            self.tokens += diff.numel()

    @property
    def mean(self) -> float | None:
        return self.total / self.tokens if self.tokens else None


def _entropy(logp: torch.Tensor) -> float:
    """The summed entropy of the distributions whose logprobs are the rows of `logp` (a token a
    grammar forbade is given logprob 0 here, so that it adds exp(0)·0 = 0)."""
    return float(-(logp.exp() * logp).sum())


class Scored(NamedTuple):
    logp: torch.Tensor
    entropy: float | None
    dense_kl: torch.Tensor | None


class Trainer:
    def __init__(self, model: torch.nn.Module, actor: ActorConfig, train: TrainConfig, adapters: AdaptersConfig | None = None):
        self.actor = actor
        self.train = train
        self.device = torch.device(train.device)
        model.set_attn_implementation(train.attn_implementation)
        self.model = model.to(self.device)
        self.step_count = 0
        if adapters is not None and adapters.kind == "lora":
            from flywheel.train.adapters import AdapterSet  # PEFT loads (2 s) only where adapters train

            self.adapters: AdapterSet | None = AdapterSet(self.model, adapters, actor, train)
            return  # the base is the KL reference; each adapter has its own optimizer
        self.adapters = None
        if train.fsdp:
            self.model = shard(self.model)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if actor.kl_coef > 0 else None
        opt = actor.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, opt, train.max_steps)

    def _autocast(self) -> Any:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda" and self.train.autocast)

    def token_logprobs(self, batch: MicroBatch, model: torch.nn.Module | None = None,
                       with_entropy: bool = False, dense: DenseStats | None = None) -> Scored:
        """The logprob of each token given its prefix (0 at position 0); with `with_entropy` the
        summed entropy of the predictions of loss-mask tokens; with `dense` the summed top-k
        distillation divergence where the batch carries the teacher's top tokens
        (flywheel/train/distill.py). Tokens drawn under a grammar are over the tokens it allowed.
        On the trainer's model, with the batch's adapter active."""
        if model is None and self.adapters is not None:
            self.adapters.activate(batch.adapter)
        with self._autocast():
            logits = (model or self.model)(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False,
            ).logits
        logits = logits[:, :-1].float() / batch.temperatures[:, 1:].unsqueeze(2)
        targets = batch.input_ids[:, 1:]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(2, targets.unsqueeze(2)).squeeze(2)
        rows, cols = batch.grammar_at[:, 0], batch.grammar_at[:, 1] - 1  # each predicted from the position before
        masked = None
        if rows.numel():
            forbidden = ~allowed_tokens(batch.grammar_allowed, logits.shape[-1])
            masked = torch.log_softmax(logits[rows, cols].masked_fill(forbidden, float("-inf")), dim=-1)
            logp = logp.index_put((rows, cols), masked.gather(1, targets[rows, cols].unsqueeze(1)).squeeze(1))
        entropy = None
        if with_entropy:  # only where it is reported: over the vocabulary, it is not cheap
            with torch.no_grad():
                counted, entropy = batch.loss_mask[:, 1:].bool(), 0.0
                if masked is not None:  # grammar tokens (all on the loss mask): the masked distribution's
                    counted = counted.index_put((rows, cols), torch.tensor(False, device=counted.device))
                    entropy = _entropy(masked.masked_fill(forbidden, 0.0))
                entropy += _entropy(logp_all[counted])
        pad = torch.zeros((logp.shape[0], 1), dtype=logp.dtype, device=logp.device)
        return Scored(torch.cat([pad, logp], dim=1), entropy, None if dense is None else topk_kl(
            logp_all, batch, dense, forward=self.actor.opd_topk_divergence == "forward"))

    def _to_device(self, batch: MicroBatch) -> MicroBatch:
        if self.device.type == "cpu":
            return batch
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
        return MicroBatch(**moved)

    def step(self, minibatches: list[list[MicroBatch]], version: int | Mapping[str, int] | None = None) -> dict[str, Any]:
        """One training step; `version` is the policy version of the current weights, or of each
        adapter (for `behav_logprob_gap`)."""
        started = time.perf_counter()
        self.model.eval()  # dropout off, as the engine samples; gradients flow all the same
        minibatches = [[self._to_device(b) for b in minibatch] for minibatch in minibatches if minibatch]
        names = list(dict.fromkeys(b.adapter for minibatch in minibatches for b in minibatch if b.adapter is not None))
        prox, gap = self._proximal(minibatches, version)
        distilled = DistillStats()
        for minibatch, minibatch_prox in zip(minibatches, prox):
            for batch, prox_logp in zip(minibatch, minibatch_prox):
                student = batch.behav_logp if prox_logp is None else prox_logp
                add_distillation(batch, student, self.actor.opd_coef, self.actor.opd_clip, distilled)
        stats: LossStats | None = None
        dense = DenseStats() if self.actor.opd_topk_coef else None
        loss_sum = kl_sum = entropy_sum = grad_norm_sum = 0.0
        passes = [pair for _ in range(self.actor.ppo_epochs) for pair in zip(minibatches, prox)]
        for minibatch, minibatch_prox in passes:
            totals: Counter[str | None] = Counter()
            for b in minibatch:
                totals[b.adapter] += float(b.loss_mask.sum())
            self._zero_grad(list(totals))
            for batch, prox_logp in zip(minibatch, minibatch_prox):
                total = totals[batch.adapter]
                logp, entropy, dense_kl = self.token_logprobs(batch, with_entropy=True, dense=dense)
                loss, part = decoupled_ppo_loss(
                    logp, batch.behav_logp if prox_logp is None else prox_logp, batch.behav_logp, batch.advantages,
                    batch.loss_mask, self.actor.eps_clip, self.actor.behav_imp_weight_cap,
                    self.actor.behav_imp_weight_cap_mode, self.actor.dual_clip, denominator=total,
                )
                if dense_kl is not None:
                    loss = loss + self.actor.opd_topk_coef * dense_kl / max(total, 1.0)
                if self.actor.kl_coef > 0:
                    with torch.no_grad(), self._reference() as reference:
                        ref_logp = self.token_logprobs(batch, reference).logp
                    kl = k3_kl(logp, ref_logp, batch.loss_mask, total)
                    loss = loss + self.actor.kl_coef * kl
                    kl_sum += float(kl.detach())
                loss.backward()
                loss_sum += float(loss.detach())
                entropy_sum += entropy
                stats = part if stats is None else stats.merge(part)
            grad_norm_sum += self._optimizer_step(list(totals))
        lr = self._schedule(names)
        self.step_count += 1
        assert stats is not None, "a training step needs at least one micro-batch"
        batches = [b for minibatch in minibatches for b in minibatch]
        computed = sum(b.computed_tokens for b in batches)
        elapsed = time.perf_counter() - started
        n = len(passes)
        return {
            "loss": loss_sum / n,
            "kl": kl_sum / n if self.actor.kl_coef > 0 else None,
            "grad_norm": grad_norm_sum / n if math.isfinite(grad_norm_sum) else None,
            "lr": lr,
            "entropy": entropy_sum / max(float(sum(b.loss_mask.sum() for b in batches)), 1.0),
            "clip_fraction": stats.clip_fraction,
            "behav_weight_mean": stats.behav_weight_mean,
            "behav_weight_max": stats.behav_weight_max,
            "capped_fraction": stats.capped_fraction,
            "behav_logprob_gap": gap.mean,
            "behav_logprob_gap_max": gap.max,
            **distilled.metrics(),
            **(dense or DenseStats()).metrics(),
            "gap_tokens": gap.tokens,
            "grammar_tokens": sum(int(b.grammar_at.shape[0]) for b in batches),
            "minibatches": len(minibatches),
            "optimizer_steps": n,
            "tokens": stats.tokens,
            "real_tokens": sum(b.real_tokens for b in batches),
            "computed_tokens": computed,
            "micro_batches": len(batches),
            "step_s": elapsed,
            "tokens_per_s": computed / elapsed if elapsed > 0 else None,
            **({"adapters": names} if self.adapters is not None else {}),
        }

    def _reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The frozen reference policy of the KL penalty: the base without adapters, or the copy
        of the initial weights."""
        return self.adapters.disabled() if self.adapters is not None else contextlib.nullcontext(self.reference)

    def _zero_grad(self, adapters: list[str | None]) -> None:
        if self.adapters is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.adapters.zero_grad(adapters)

    def _optimizer_step(self, adapters: list[str | None]) -> float:
        """Clip and step (the model's optimizer, or each of `adapters`'); the gradient norm (their mean)."""
        if self.adapters is None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.actor.optimizer.max_grad_norm))
            self.optimizer.step()
            return norm
        return sum(self.adapters.clip_and_step(name) for name in adapters) / len(adapters)

    def _schedule(self, adapters: list[str]) -> float:
        """One learning-rate schedule step (the model's, or each of `adapters`'); the rate before it."""
        if self.adapters is not None:
            lr = self.adapters.schedule(adapters)
            self.adapters.trim()  # the step's adapters are the most recently used: the others leave memory first
            return lr
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return lr

    def _proximal(self, minibatches: list[list[MicroBatch]],
                  version: int | Mapping[str, int] | None) -> tuple[list[list[torch.Tensor | None]], "GapStats"]:
        """π_prox's logprobs of every micro-batch (None where the loss is not decoupled: it
        uses π_behav), and how far they are from the engine's on the current version's tokens."""
        gap = GapStats()
        if not self.actor.recompute_logprobs:
            return [[None] * len(minibatch) for minibatch in minibatches], gap
        prox = []
        with torch.no_grad():
            for minibatch in minibatches:
                logps = [self.token_logprobs(batch).logp for batch in minibatch]
                for batch, logp in zip(minibatch, logps):
                    gap.add(logp, batch, version.get(batch.adapter, 0) if isinstance(version, Mapping) else version)
                prox.append(logps if self.actor.use_decoupled_loss else [None] * len(minibatch))
        return prox, gap

    def state(self) -> dict[str, Any]:
        if self.adapters is not None:
            return {"adapters": self.adapters.state(), "step": self.step_count}
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step_count}

    def restore(self, state: dict[str, Any]) -> None:
        if self.adapters is not None:
            self.adapters.restore(state["adapters"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
