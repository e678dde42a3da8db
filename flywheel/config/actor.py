"""The `actor` section: the optimizer and the objective's coefficients (flywheel/train/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flywheel.config.section import Section


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: keep `lr`, or decay it linearly or along a cosine to `min_lr_ratio`·lr
    at `schedule_steps`."""
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly from 0 to `lr`."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    schedule_steps: int | None = Field(None, ge=1)
    """Where a decaying schedule ends; None: `train.max_steps` (required for a decay)."""


class ActorConfig(Section):
    """The policy being trained and its objective, every coefficient of it: decoupled PPO's clip
    and behaviour weights, the KL penalty, and how outcome rewards, per-turn rewards and hint
    distillation make each token's advantage (docs/architecture.md)."""

    optimizer: OptimizerConfig = OptimizerConfig()
    eps_clip: float = Field(0.2, gt=0)
    behav_imp_weight_cap: float | None = Field(5.0, gt=1.0)
    """Cap on π_prox/π_behav; what happens above it is `behav_imp_weight_cap_mode`. None: no cap."""
    behav_imp_weight_cap_mode: Literal["mask", "clamp"] = "mask"
    """`mask`: tokens above the cap leave the loss (AReaL); `clamp`: their weight is the cap."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip PPO's c: for negative advantages the objective is bounded below by c·Â."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of a KL penalty to the reference policy (the weights the run started from), per
    token with the k3 estimator; 0 turns it off (and keeps no reference copy)."""
    use_decoupled_loss: bool = True
    recompute_logprobs: bool = True
    """Recompute π_prox with one no-grad pass at the start of each step."""
    ppo_n_minibatches: int = Field(4, ge=1)
    """Optimizer steps per training step: the batch is split into this many minibatches (whole
    samples, about equal tokens), all weighed against the π_prox of the step's start. More than
    one makes the PPO clip a real trust region; 1 is a single policy-gradient step."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the minibatches per step (PPO's epochs), each against the step's π_prox."""
    turn_reward_coef: float = Field(0.0, ge=0.0)
    """β: how much a judge's per-turn rewards add to a turn's advantage (see flywheel/train/advantages.py);
    0: the outcome alone. Per-turn rewards should be centred: in groups `turn_reward_norm` does it;
    for live traffic (groups of one) use the composite judge's normalisation (raw scores in
    [0, 1] would push every turn up)."""
    turn_discount: float = Field(1.0, ge=0.0, le=1.0)
    """γ: per-turn rewards reach earlier turns of the same conversation discounted by γ per turn."""
    rl_coef: float = Field(1.0, ge=0.0)
    """w_rl: the weight of the RL advantage in each token's advantage (flywheel/train/distill.py)."""
    rl_coef_hinted: float | None = Field(None, ge=0.0)
    """w_rl on the turns a teacher scored (a hint reached them); None: `rl_coef`. 0: a corrected
    turn learns from the teacher alone (its -1 on every sampled token otherwise drowns the
    teacher's pull toward what the hint asks: bench/hint_update.py); other turns keep `rl_coef`, and
    so do practice replies rewarded by a check of the wish (`judge.teacher.practice_reward: checks`)."""
    opd_coef: float = Field(1.0, ge=0.0)
    """w_opd: the weight of hint distillation, clip(log π_teacher − log π_student, ±opd_clip), on
    tokens a teacher scored (`Sample.teacher_logprobs`); 0 turns it off."""
    opd_clip: float = Field(2.0, gt=0.0)
    """c: the teacher − student log-probability difference is clipped to [−c, c] (nats)."""
    opd_topk_coef: float = Field(0.0, ge=0.0)
    """β: dense hint distillation, the weight of a KL divergence between the policy and the teacher
    over the teacher's top-k tokens (`judge.teacher.top_k`) on the tokens it scored
    (flywheel/train/distill.py); 0 turns it off."""
    opd_topk_divergence: Literal["reverse", "forward"] = "reverse"
    """KL(π_θ ‖ π_teacher), or KL(π_teacher ‖ π_θ): it raises words the policy never writes."""
    turn_reward_norm: Literal["group", "none"] = "group"
    """`group`: a task group's per-turn rewards are normalised among the members' rewards for the
    same step, (r − mean) / std, like outcomes (OpenClaw-RL v2's per (task, step) normalisation;
    the trainer holds groups whole, so no order of arrival matters); a sample alone in its group
    keeps its judge's rewards. `none`: as the judge gave them."""

    @model_validator(mode="after")
    def _decoupled_needs_recompute(self) -> "ActorConfig":
        if self.use_decoupled_loss and not self.recompute_logprobs:
            raise ValueError(
                "actor.use_decoupled_loss=true requires actor.recompute_logprobs=true "
                "(the proximal policy's logprobs must be recomputed)"
            )
        return self
