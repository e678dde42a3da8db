"""The training step's machinery on the real tiny model: packed rows give the same logprobs as
padded ones (and as the engine's), micro-batches accumulate to the gradient of one big batch,
per-turn rewards reach the right tokens, the learning-rate schedule, KL to the reference, and
the FSDP guard."""

import math

import msgspec
import pytest
import torch

from flywheel.bus import Sample, Segment, Trajectory
from flywheel.config import ConfigError, load_config
from flywheel.models import load_model
from flywheel.train.advantages import token_advantages, turn_returns
from flywheel.train.fsdp import shard
from flywheel.train.packing import Row, micro_batches
from flywheel.train.schedule import lr_factor
from flywheel.train.trainer import Trainer

from factories import make_turn, rows_of, sample_of, sampled_turns


@pytest.fixture(scope="module")
async def samples():
    """Six engine samples cut to different lengths (a prefix of what was sampled is still exact)."""
    turns = await sampled_turns(6)
    cut = [msgspec.structs.replace(t, output_ids=t.output_ids[: 3 + i], output_logprobs=t.output_logprobs[: 3 + i],
                                   output_versions=t.output_versions[: 3 + i]) for i, t in enumerate(turns)]
    return [sample_of(turn, reward=float(i % 2)) for i, turn in enumerate(cut)]


def trainer_for(*overrides: str) -> Trainer:
    model, _ = load_model("tiny")
    config = load_config(None, list(overrides))
    return Trainer(model, config.actor, config.train)


def per_token(trainer, batches) -> list[list[float]]:
    """Each sampled token's logprob, in the order of the rows' sampled tokens."""
    out = []
    with torch.no_grad():
        for batch in batches:
            logp = trainer.token_logprobs(batch).logp
            out += sorted(logp[batch.loss_mask.bool()].tolist())
    return sorted(out)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
async def test_packed_rows_give_the_padded_and_the_engine_logprobs(samples, attention):
    trainer = trainer_for(f"train.attn_implementation={attention}")
    assert trainer.model.config._attn_implementation == attention
    rows = rows_of(samples, [1.0] * len(samples))
    packed = micro_batches(rows, budget=10_000, pad_id=0, packing=True)
    padded = micro_batches(rows, budget=10_000, pad_id=0, packing=False)
    [batch] = packed
    assert batch.attention_mask is None and batch.real_tokens == sum(len(r) for r in rows)
    engine = sorted(lp for s in samples for seg in s.trajectory.segments for lp, m in zip(seg.logprobs, seg.loss_mask) if m)
    assert per_token(trainer, packed) == pytest.approx(per_token(trainer, padded), abs=1e-5)
    assert per_token(trainer, packed) == pytest.approx(engine, abs=2e-4)


def test_packing_fills_rows_as_long_as_the_longest_segment_within_the_budget():
    def row(n: int) -> Row:
        return Row(Segment(token_ids=list(range(n)), loss_mask=[0] + [1] * (n - 1), logprobs=[0.0] * n, versions=[0] * n),
                   [1.0] * n)

    rows = [row(n) for n in (10, 6, 4, 3, 3, 2, 2)]
    packed = micro_batches(rows, budget=20, pad_id=0, packing=True)
    assert [tuple(b.input_ids.shape) for b in packed] == [(2, 10), (1, 10)]  # rows: 10 | 6+4 | 3+3+2+2
    assert sum(b.real_tokens for b in packed) == 30 and sum(b.computed_tokens for b in packed) == 30
    assert packed[0].position_ids[1].tolist() == list(range(6)) + list(range(4))
    padded = micro_batches(rows, budget=20, pad_id=0, packing=False)
    assert sum(b.computed_tokens for b in padded) > 30


async def test_micro_batches_accumulate_to_the_gradient_of_one_batch(samples):
    rows = rows_of(samples, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    one, many = (trainer_for("actor.optimizer.max_grad_norm=1e9", "actor.ppo_n_minibatches=1") for _ in range(2))
    whole = micro_batches(rows, budget=100_000, pad_id=0)
    split = micro_batches(rows, budget=max(len(r) for r in rows), pad_id=0)
    assert len(whole) == 1 and len(split) > 2
    m1, m2 = one.step([whole]), many.step([split])
    assert m2["micro_batches"] == len(split) and m1["tokens"] == m2["tokens"]
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6)
    for (name, p1), p2 in zip(one.model.named_parameters(), many.model.parameters()):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-3, atol=1e-6), name


def test_turn_rewards_reach_their_turn_and_earlier_ones_discounted():
    assert turn_returns([1.0, 0.0, 2.0], discount=0.5) == [1.5, 1.0, 2.0]
    turns = [make_turn(id=f"t{i}", turn_index=i) for i in range(2)]
    segment = Segment(token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 1, 1, 0, 1, 1], logprobs=[0.0] * 6, versions=[0] * 6,
                      turn_spans=[(0, 1, 3), (1, 4, 6)])
    trajectory = Trajectory(id="x", session_id="x", segments=[segment], turns=turns, close_reason="feedback")
    sample = Sample(id="x", trajectory=trajectory, reward=1.0, turn_rewards=[0.5, -1.0], judge="llm")
    [values] = token_advantages(sample, advantage=0.25, coef=2.0, discount=0.5)
    first, second = 0.25 + 2.0 * (0.5 + 0.5 * -1.0), 0.25 + 2.0 * -1.0
    assert values == [0.0, first, first, 0.0, second, second]
    [plain] = token_advantages(sample, advantage=0.25, coef=0.0, discount=0.5)
    assert plain == [0.0, 0.25, 0.25, 0.0, 0.25, 0.25]


def test_learning_rate_schedules():
    opt = load_config(None, ["actor.optimizer.warmup_steps=4", "actor.optimizer.lr_schedule=cosine",
                             "actor.optimizer.min_lr_ratio=0.1"]).actor.optimizer
    factors = [lr_factor(step, opt, total_steps=14) for step in range(16)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[14] == factors[15] == pytest.approx(0.1)
    linear = opt.model_copy(update={"lr_schedule": "linear", "warmup_steps": 0, "min_lr_ratio": 0.0})
    assert [lr_factor(s, linear, 4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ConfigError, match="actor.optimizer.schedule_steps"):
        trainer_for("actor.optimizer.lr_schedule=linear")


async def test_kl_to_the_reference_is_zero_at_the_start_and_grows_after_steps(samples):
    trainer = trainer_for("actor.kl_coef=0.5", "actor.optimizer.lr=0.05", "actor.ppo_n_minibatches=1")
    batches = micro_batches(rows_of(samples, [1.0, -1.0] * 3), budget=100_000, pad_id=0)
    first = trainer.step([batches])
    second = trainer.step([batches])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 1e-4


def test_flash_attention_is_refused_with_packing():
    with pytest.raises(ConfigError, match="train.attn_implementation: flash_attention_2 would attend across"):
        load_config(None, ["train.attn_implementation=flash_attention_2"])
    assert load_config(None, ["train.attn_implementation=flash_attention_2", "train.packing=false"]).train.packing is False


def test_fsdp_is_refused_without_a_process_group():
    with pytest.raises(ConfigError, match="train.fsdp: needs an initialised torch.distributed process group"):
        shard(load_model("tiny")[0])
