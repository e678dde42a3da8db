"""Hint distillation as a per-token advantage (OpenClaw-RL's on-policy distillation, OPD).

When what followed a turn says how to do better (a correction, feedback text: a hint), a
teacher (the pinned model, told the hint) scores every token the policy sampled in that turn
(`Sample.teacher_logprobs`). A token the teacher finds likelier than the student does is one the
policy should move toward. Per token, under the same decoupled PPO objective and off-policy
corrections as the RL advantage Â:

    A_t = w_rl · Â_t + w_opd · clip(log π_teacher(a_t) − log π_student(a_t), −c, c)

(`actor.rl_coef`, `actor.opd_coef`, `actor.opd_clip`); tokens with no teacher log-probability get
the RL term alone. On a turn a teacher scored, w_rl is `actor.rl_coef_hinted` when set
(flywheel/train/step_batch.py): 0 leaves it to the teacher; a practice reply rewarded by a check
of what the person asked keeps `rl_coef` (its reward is not the hint's -1). The student is π_prox
under the decoupled objective (the weights this step starts from: the policy the update moves,
whatever version sampled the tokens, so the OPD term and the objective's ratio speak of the same
weights), else the engine's π_behav (standard PPO,
where π_prox is π_behav). The clip keeps a token the teacher all but forbids from
dominating the step (OpenClaw-RL v2 clips the difference too).

**Dense** (`actor.opd_topk_coef` β > 0, with `judge.teacher.top_k` k): the sampled token says
only how the teacher rates what was written; the teacher's distribution at the same position also
says what it would have written instead ("Maya," where the policy began "To ..."). Where the
sample carries the teacher's k likeliest tokens, the loss adds β times a KL divergence between
the policy and the teacher over k + 1 bins, those k tokens and the rest of the vocabulary,
averaged like the loss over the step's loss tokens (`actor.opd_topk_divergence`):

    reverse  KL_t = Σ_b π_θ(b) · (log π_θ(b) − log π_teacher(b)),  b ∈ {top-k tokens, the tail}
    forward  KL_t = Σ_b π_teacher(b) · (log π_teacher(b) − log π_θ(b))

The reverse divergence is OpenClaw-RL's top-K distillation (after SDFT/SDPO): mode-seeking, it
pushes down what the teacher would not write, but its pull on a token the policy all but never
writes is that token's own probability (∂KL/∂z_b = π_θ(b) · (log π_θ(b)/π_teacher(b) − KL)): a
word the hint brings in, 0.15 for the teacher and 1e-4 for the policy, is pulled ~1e-3. The
forward one pulls a token up by about π_teacher(b) − π_θ(b) (as supervised distillation does;
GKD's other end), that word by ~0.15. Either is a divergence at the states the policy
visited, not a policy-gradient estimate, so it needs no importance weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flywheel.train.packing import MicroBatch


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


@dataclass
class DenseStats:
    tokens: int = 0
    """Loss tokens with the teacher's top-k tokens."""
    kl_sum: float = 0.0

    def metrics(self) -> dict[str, float | int | None]:
        return {"opd_topk_tokens": self.tokens, "opd_topk_kl": self.kl_sum / self.tokens if self.tokens else None}


def _with_tail(top: torch.Tensor) -> torch.Tensor:
    """k log-probabilities and, as a (k+1)-th bin, the log of the probability left to the rest."""
    mass = torch.logsumexp(top, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([top, torch.log(-torch.expm1(mass))], dim=-1)


def topk_kl(logp_all: torch.Tensor, batch: MicroBatch, stats: DenseStats, forward: bool = False) -> torch.Tensor:
    """Σ over the loss tokens that carry the teacher's top-k of KL(π_θ ‖ π_teacher) (`forward`:
    KL(π_teacher ‖ π_θ)) over k + 1 bins (see the module); `logp_all` [rows, T − 1, vocab] is the
    policy's log-distribution of each next token (position t predicts token t + 1). A zero with no
    such token."""
    ids = batch.teacher_top_ids[:, 1:]
    if not ids.shape[-1]:
        return logp_all.new_zeros(())
    taught = (ids[..., 0] >= 0) & batch.loss_mask[:, 1:].bool()
    if not bool(taught.any()):
        return logp_all.new_zeros(())
    student = _with_tail(logp_all[taught].gather(1, ids[taught]))
    teacher = _with_tail(batch.teacher_top_logp[:, 1:][taught].to(student.dtype))
    kl = (teacher.exp() * (teacher - student) if forward else student.exp() * (student - teacher)).sum(-1)
    stats.tokens += int(taught.sum())
    stats.kl_sum += float(kl.detach().sum())
    return kl.sum()
