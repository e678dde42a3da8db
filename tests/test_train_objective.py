"""The decoupled PPO loss and its gradients against hand-computed values; advantages."""

import math

import pytest
import torch

from flywheel.train.advantages import RunningBaseline, group_advantages
from flywheel.train.loss import decoupled_ppo_loss

E = math.e


def tensors():
    logp = torch.tensor([-0.5, -0.5, -1.0, -3.0], requires_grad=True)
    prox = torch.tensor([-1.0, -0.5, -1.0, -1.0])
    behav = torch.tensor([-1.0, -1.0, -2.0, -1.0])
    adv = torch.tensor([1.0, -2.0, 0.5, 4.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    return logp, prox, behav, adv, mask


def test_capped_tokens_are_masked_and_clipped_tokens_carry_no_gradient():
    logp, prox, behav, adv, mask = tensors()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=2.0)
    # token 0: w=1, u=e^0.5 -> clipped to 1.2 -> -1.2 ; token 1: w=e^0.5, u=1 -> -w*(-2)
    # token 2: w=e > 2 -> masked ; token 3: off the loss mask
    w1 = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.2 + 2 * w1) / 2, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, w1, 0.0, 0.0], rel=1e-6)
    assert stats.tokens == 2
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.capped_fraction == pytest.approx(1 / 3)
    assert stats.behav_weight_max == pytest.approx(E, rel=1e-6)


def test_clamp_mode_keeps_capped_tokens_with_a_clamped_weight():
    logp, prox, behav, adv, mask = tensors()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 2.0, cap_mode="clamp")
    w1 = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.2 + 2 * w1 - 2.0 * 0.5) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 2 * w1 / 3, -1.0 / 3, 0.0], rel=1e-6)
    assert stats.tokens == 3


def test_standard_ppo_when_prox_is_behaviour():
    logp, _, behav, adv, mask = tensors()
    loss, stats = decoupled_ppo_loss(logp, behav, behav, adv, mask, 0.2, None)
    u = [math.exp(0.5), math.exp(0.5), math.exp(1.0)]
    per = [-min(u[0] * 1.0, 1.2 * 1.0), -min(u[1] * -2.0, 1.2 * -2.0), -min(u[2] * 0.5, 1.2 * 0.5)]
    assert loss.item() == pytest.approx(sum(per) / 3, rel=1e-6)
    assert stats.behav_weight_mean == pytest.approx(1.0)


def test_negative_advantage_clips_below():
    logp = torch.tensor([-2.0], requires_grad=True)  # u = e^-1 < 0.8
    loss, stats = decoupled_ppo_loss(logp, torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([-1.0]), torch.ones(1), 0.2)
    assert loss.item() == pytest.approx(0.8)  # -(min(u*-1, 0.8*-1)) = 0.8
    loss.backward()
    assert logp.grad.item() == 0.0 and stats.clip_fraction == 1.0


def test_group_advantages_normalise_within_groups_and_baseline_singletons():
    baseline = RunningBaseline(decay=0.5)
    adv = group_advantages([1.0, 0.0, 0.5, 1.0, 1.0, 0.3], ["a", "a", "a", "b", "b", None], baseline)
    std = math.sqrt(((0.5) ** 2 + 0.5**2 + 0) / 3)
    assert adv[:3] == pytest.approx([0.5 / std, -0.5 / std, 0.0], rel=1e-4)
    assert adv[3:5] == [0.0, 0.0]  # no spread, nothing to learn
    assert adv[5] == 0.0 and baseline.value == 0.3  # first singleton: its own baseline
    assert group_advantages([1.3], [None], baseline) == pytest.approx([1.0])
    assert baseline.value == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantages_and_leaves_positive_ones():
    # u = e^1.5 ≈ 4.48 on both tokens: Â = -1 gives min(u·Â, 1.2·Â) = -4.48, bounded below by c·Â = -3.
    logp = torch.tensor([-0.5, -0.5], requires_grad=True)
    prox = behav = torch.tensor([-2.0, -2.0])
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, None, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == [0.0, 0.0]  # both bounds are constants
    plain, _ = decoupled_ppo_loss(logp.detach(), prox, behav, adv, mask, 0.2, None)
    assert plain.item() == pytest.approx((math.exp(1.5) - 1.2) / 2, rel=1e-6)


def test_a_given_denominator_makes_micro_batch_losses_add_up_to_the_global_mean():
    logp, prox, behav, adv, mask = tensors()
    whole, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 2.0)
    parts = [decoupled_ppo_loss(logp[i:i + 2], prox[i:i + 2], behav[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, 2.0,
                                denominator=2.0)[0] for i in (0, 2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)
