"""Hint distillation as a per-token advantage (OpenClaw-RL's on-policy distillation, OPD).

When what followed a turn says how to do better (a correction, feedback text: a hint), a
teacher (the pinned model, told the hint) scores every token the policy sampled in that turn
(`Sample.teacher_logprobs`). A token the teacher finds likelier than the student does is one the
policy should move toward. Per token, under the same decoupled PPO objective and off-policy
corrections as the RL advantage Â:

    A_t = w_rl · Â_t + w_opd · clip(log π_teacher(a_t) − log π_student(a_t), −c, c)

(`train.rl_coef`, `train.opd_coef`, `train.opd_clip`); tokens with no teacher log-probability get
the RL term alone. The student is π_prox under the decoupled objective (the weights this step
starts from: the policy the update moves, whatever version sampled the tokens, so the OPD term
and the objective's ratio speak of the same weights), else the engine's π_behav (standard PPO,
where π_prox is π_behav). The clip keeps a token the teacher all but forbids from
dominating the step (OpenClaw-RL v2 clips the difference too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.packing import MicroBatch


@dataclass
class DistillStats:
    tokens: int = 0
    """Loss tokens with a teacher log-probability."""
    gap_sum: float = 0.0
    """Σ (log π_teacher − log π_student) over them."""
    advantage_sum: float = 0.0
    advantage_abs_sum: float = 0.0
    clipped: int = 0

    def metrics(self) -> dict[str, float | int | None]:
        n = self.tokens
        return {
            "opd_tokens": n,
            "opd_gap_mean": self.gap_sum / n if n else None,
            "opd_advantage_mean": self.advantage_sum / n if n else None,
            "opd_advantage_abs_mean": self.advantage_abs_sum / n if n else None,
            "opd_clip_fraction": self.clipped / n if n else None,
        }


def add_distillation(batch: MicroBatch, student_logp: torch.Tensor, coef: float, clip: float, stats: DistillStats) -> None:
    """Add w_opd · clip(teacher − student) to `batch.advantages` where a teacher scored a loss
    token (the RL part is already scaled by w_rl); count into `stats`."""
    taught = ~torch.isnan(batch.teacher_logp) & batch.loss_mask.bool()
    if not coef or not bool(taught.any()):
        return
    gap = batch.teacher_logp[taught] - student_logp[taught].to(batch.teacher_logp.dtype)
    term = gap.clamp(-clip, clip)
    batch.advantages[taught] += coef * term.to(batch.advantages.dtype)
    stats.tokens += int(taught.sum())
    stats.gap_sum += float(gap.sum())
    stats.advantage_sum += float(coef * term.sum())
    stats.advantage_abs_sum += float(coef * term.abs().sum())
    stats.clipped += int((gap.abs() > clip).sum())
