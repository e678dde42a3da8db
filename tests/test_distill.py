"""Hint distillation in the trainer: teacher log-probabilities travel on the sample aligned with
the tokens the policy sampled, through packing and padding, and become
w_rl · Â + w_opd · clip(log π_teacher − log π_student, −c, c) per token, the student being π_prox.
The teacher here is the real embedded engine scoring what the policy sampled under a prompt
that carries a hint (a prefill-only request, as the judge's teacher does)."""

from __future__ import annotations

import array
import math

import pytest
import torch

from bus import Sample
from bus.arrays import Float64s
from collect.stitch import stitch
from config import load_config
from models import load_model
from serve.engine import Engine, SamplingParams
from tests.test_records import make_turn
from tests.test_train_loop import sample_of, sampled_turns
from train.advantages import RunningBaseline
from train.distill import DistillStats, add_distillation
from train.grouping import Group, Member
from train.packing import Row, micro_batches
from train.step_batch import StepBatch
from train.trainer import Trainer

NAN = float("nan")


def group_of(sample: Sample) -> Group:
    return Group(sample.id, 1, 0.0, 0.0, {sample.id: Member(sample, [])})


def taught(sample: Sample, values_of_turn: list[float]) -> Sample:
    """The sample with a teacher's log-probabilities on its (one) turn's sampled tokens."""
    [segment] = sample.trajectory.segments
    [(_, start, end)] = segment.turn_spans
    teacher = [NAN] * len(segment.token_ids)
    teacher[start:end] = values_of_turn
    sample.teacher_logprobs = [Float64s(teacher)]
    return sample


@pytest.fixture(scope="module")
async def turns():
    return await sampled_turns(3)


@pytest.mark.parametrize("packing", ["true", "false"])
async def test_teacher_logprobs_stay_on_the_tokens_they_score_through_packing(turns, packing):
    samples = [sample_of(t, 1.0) for t in turns]
    marked = taught(samples[1], [-(k + 1) / 10 for k in range(len(turns[1].output_ids))])
    config = load_config(None, [f"train.packing={packing}", "actor.ppo_n_minibatches=1", "train.micro_batch_tokens=64"])
    batch = StepBatch([group_of(s) for s in samples], config, RunningBaseline(), 0)
    found = []
    for micro in (b for minibatch in batch.minibatches for b in minibatch):
        at = ~torch.isnan(micro.teacher_logp)
        assert bool((micro.loss_mask[at] == 1).all())  # only ever on sampled tokens
        found += list(zip(micro.input_ids[at].tolist(), micro.teacher_logp[at].tolist()))
    expected = list(zip(turns[1].output_ids, marked.teacher_logprobs[0][-len(turns[1].output_ids):]))
    assert [i for i, _ in sorted(found)] == [i for i, _ in sorted(expected)]
    assert [v for _, v in sorted(found)] == pytest.approx([v for _, v in sorted(expected)])
    assert batch.hinted_turns == 1 and batch.turns == 3


def test_the_combined_advantage_is_the_rl_term_plus_the_clipped_teacher_gap():
    turn = make_turn(prompt_ids=[1, 2], output_ids=[3, 4, 5], output_logprobs=[-1.0, -1.0, -1.0], output_versions=[0, 0, 0])
    [segment] = stitch([turn])
    teacher = [NAN, NAN, -0.5, -4.0, NAN]  # tokens 3 and 4 taught; 5 not
    [batch] = micro_batches([Row(segment, [0.0, 0.0, 0.5, 0.5, 0.5], teacher_logprobs=array.array("d", teacher))],
                            budget=64, pad_id=0)
    stats = DistillStats()
    add_distillation(batch, student_logp=torch.tensor([[0.0, 0.0, -1.0, -1.0, -1.0]]), coef=2.0, clip=2.0, stats=stats)
    # 0.5 + 2 * clip(-0.5 - -1.0) = 1.5;  0.5 + 2 * clip(-4.0 - -1.0 = -3 -> -2) = -3.5;  untaught: 0.5
    assert batch.advantages[0].tolist() == pytest.approx([0.0, 0.0, 1.5, -3.5, 0.5])
    assert stats.metrics()["opd_tokens"] == 2 and stats.metrics()["opd_gap_mean"] == pytest.approx((0.5 - 3.0) / 2)
    assert stats.metrics()["opd_clip_fraction"] == 0.5


async def test_a_teacher_told_a_hint_moves_the_policy_toward_what_it_prefers(turns):
    """The real engine scores the policy's sampled tokens under a prompt with a hint appended
    (a prefill-only request); one step with the RL term off raises the log-probability of the
    sampled tokens the teacher liked more than the policy did, and lowers the others'."""
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer).start()
    hinted = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write some digits.\n\n[user's hint: only the digits 1 and 2]"}],
        add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(hinted, add_special_tokens=False)
    try:
        scored = [await engine.generate(prompt + list(turn.output_ids),
                                        SamplingParams(max_new_tokens=0, logprob_start_len=len(prompt) - 1)) for turn in turns]
    finally:
        engine.stop()
    # The turn whose tokens the hint moves both ways (teacher against the recorded behaviour log-probs).
    turn, teacher = next((turn, s.input_logprobs[1:]) for turn, s in zip(turns, scored)
                         if max(t - b for t, b in zip(s.input_logprobs[1:], turn.output_logprobs)) > 0.1
                         and min(t - b for t, b in zip(s.input_logprobs[1:], turn.output_logprobs)) < -0.1)
    assert len(teacher) == len(turn.output_ids) and all(math.isfinite(v) for v in teacher)
    sample = taught(sample_of(turn, 0.0), teacher)
    config = load_config(None, ["train.rl_coef=0", "actor.optimizer.lr=0.02", "actor.ppo_n_minibatches=1"])
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
    batch = StepBatch([group_of(sample)], config, RunningBaseline(), 0)
    [[micro]] = batch.minibatches
    with torch.no_grad():
        before = trainer.token_logprobs(micro)[0][micro.loss_mask.bool()]
    gaps = torch.tensor(teacher) - before.double()
    metrics = trainer.step(batch.minibatches, version=0)
    with torch.no_grad():
        after = trainer.token_logprobs(micro)[0][micro.loss_mask.bool()]
    assert metrics["opd_tokens"] == len(teacher) and metrics["opd_gap_mean"] == pytest.approx(float(gaps.mean()), abs=1e-4)
    moved = (after - before).double()
    liked, disliked = gaps > 0.1, gaps < -0.1
    assert bool(liked.any()) and bool(disliked.any())
    assert float(moved[liked].mean()) > float(moved[disliked].mean())


async def test_a_turn_nothing_followed_is_kept_out_of_the_loss_and_counted(turns):
    """The next_state judge lists a turn it could not judge (`unjudged_turns`): its 0.0 is a
    placeholder, so its tokens leave the loss (counted `unjudged`), in a composite too."""
    config = load_config(None, ["actor.ppo_n_minibatches=1"])
    for details in ({"unjudged_turns": [0]}, {"components": {"0:next_state": {"details": {"unjudged_turns": [0]}}}}):
        sample = sample_of(turns[2], 1.0)
        sample.details = details
        batch = StepBatch([group_of(sample)], config, RunningBaseline(), 0)
        [[micro]] = batch.minibatches
        assert float(micro.loss_mask.sum()) == 0 and batch.excluded["unjudged"] == len(turns[2].output_ids)
