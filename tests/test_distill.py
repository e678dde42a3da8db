"""Hint distillation in the trainer: teacher log-probabilities travel on the sample aligned with
the tokens the policy sampled, through packing and padding, and become
w_rl · Â + w_opd · clip(log π_teacher − log π_student, −c, c) per token, the student being π_prox;
the teacher's top-k tokens travel the same way and give the dense term, the reverse KL from the
policy to the teacher over those k tokens and the rest. The teacher here is the real embedded
engine scoring what the policy sampled under a prompt that carries a hint (a prefill-only
request, as the judge's teacher does)."""

from __future__ import annotations

import array
import math

import msgspec
import pytest
import torch

from flywheel.bus import Sample
from flywheel.bus.arrays import Float64s, Int32s
from flywheel.bus.stitch import stitch
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.train.advantages import RunningBaseline
from flywheel.train.distill import DenseStats, DistillStats, add_distillation, topk_kl
from flywheel.train.grouping import Group, Member
from flywheel.train.packing import Row, TeacherTop, micro_batches
from flywheel.train.step_batch import StepBatch
from flywheel.train.trainer import Trainer

from factories import make_turn, sample_of, sampled_turns

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


def taught_top(sample: Sample, tops: list[list[tuple[int, float]]]) -> Sample:
    """The sample with a teacher's top-k (id, logprob) pairs on its (one) turn's sampled tokens."""
    [segment] = sample.trajectory.segments
    [(_, start, end)] = segment.turn_spans
    k = len(tops[0])
    ids, values = [-1] * (len(segment.token_ids) * k), [NAN] * (len(segment.token_ids) * k)
    ids[start * k:end * k] = [i for top in tops for i, _ in top]
    values[start * k:end * k] = [v for top in tops for _, v in top]
    sample.teacher_top_k, sample.teacher_top_ids, sample.teacher_top_logprobs = k, [Int32s(ids)], [Float64s(values)]
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


@pytest.mark.parametrize("packing", ["true", "false"])
async def test_the_teachers_top_tokens_stay_on_the_tokens_they_describe_through_packing(turns, packing):
    """Each sampled token of the taught turn carries k (id, logprob) pairs (here: the token itself,
    then the next two ids); wherever packing or padding puts it, they sit at its position."""
    samples = [sample_of(t, 1.0) for t in turns]
    taught_top(samples[2], [[(t, -0.1), (t + 1, -2.0), (t + 2, -3.0)] for t in turns[2].output_ids])
    config = load_config(None, [f"train.packing={packing}", "actor.ppo_n_minibatches=1", "train.micro_batch_tokens=64"])
    batch = StepBatch([group_of(s) for s in samples], config, RunningBaseline(), 0)
    found = []
    for micro in (b for minibatch in batch.minibatches for b in minibatch):
        if not micro.teacher_top_ids.shape[-1]:  # no row of this micro-batch was taught
            continue
        at = micro.teacher_top_ids[..., 0] >= 0
        assert bool((micro.loss_mask[at] == 1).all())
        assert micro.teacher_top_ids[at].tolist() == [[t, t + 1, t + 2] for t in micro.input_ids[at].tolist()]
        assert micro.teacher_top_logp[at].flatten().tolist() == pytest.approx([-0.1, -2.0, -3.0] * int(at.sum()))
        found += micro.input_ids[at].tolist()
    assert sorted(found) == sorted(turns[2].output_ids)


async def test_dense_distillation_moves_the_policys_distribution_toward_the_teachers(turns):
    """A teacher sure of one token the policy finds unlikely (its top-2: that token at 0.9, another
    at 0.05): one step of the dense term alone (no RL, no token-level term) raises that token's
    probability at every taught position and lowers the k+1-bin KL from the policy to the teacher."""
    config = load_config(None, ["actor.rl_coef=0", "actor.opd_coef=0", "actor.opd_topk_coef=1", "actor.optimizer.lr=0.01",
                                "actor.ppo_n_minibatches=1"])
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
    wanted, other = 7, 8
    samples = [taught_top(sample_of(turn, 0.0), [[(wanted, math.log(0.9)), (other, math.log(0.05))]] * len(turn.output_ids))
               for turn in turns]
    batch = StepBatch([group_of(s) for s in samples], config, RunningBaseline(), 0)
    micros = [b for minibatch in batch.minibatches for b in minibatch]

    def measured() -> tuple[float, float]:
        """(the mean KL per taught token, the mean probability of `wanted` there)."""
        stats, probability = DenseStats(), []
        with torch.no_grad():
            for micro in micros:
                trainer.token_logprobs(micro, dense=stats)
                logits = trainer.model(input_ids=micro.input_ids, position_ids=micro.position_ids).logits[:, :-1]
                taught = micro.teacher_top_ids[:, 1:, 0] >= 0
                probability += torch.softmax(logits / micro.temperatures[:, 1:, None], -1)[..., wanted][taught].tolist()
        return stats.kl_sum / stats.tokens, sum(probability) / len(probability)

    kl_before, p_before = measured()
    metrics = trainer.step(batch.minibatches, version=0)
    kl_after, p_after = measured()
    assert metrics["opd_topk_tokens"] == sum(len(t.output_ids) for t in turns) and metrics["opd_tokens"] == 0
    assert metrics["opd_topk_kl"] == pytest.approx(kl_before, rel=1e-4) and p_before < 0.1
    assert kl_after < kl_before and p_after > 2 * p_before  # 0.0005 -> 0.003 here: the reverse KL falls slowly while
    # the policy's mass is still in the tail bin


async def test_the_dense_term_is_zero_where_the_teacher_is_the_policy(turns):
    """The real engine's top-8 at the policy's own prompt: the policy's own distribution, so there
    is nothing to distil (the tail bin makes the k+1 bins exact)."""
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer).start()
    try:
        own = await engine.generate(list(turns[0].prompt_ids) + list(turns[0].output_ids), SamplingParams(
            max_new_tokens=0, logprob_start_len=len(turns[0].prompt_ids) - 1, top_logprobs_num=8, temperature=1.0))
    finally:
        engine.stop()
    config = load_config(None, ["actor.opd_topk_coef=1", "actor.ppo_n_minibatches=1"])
    sample = sample_of(turns[0], 0.0)
    batch = StepBatch([group_of(taught_top(sample, own.input_top_logprobs[1:]))], config, RunningBaseline(), 0)
    [[micro]] = batch.minibatches
    stats = DenseStats()
    with torch.no_grad():
        kl = Trainer(model, config.actor, config.train).token_logprobs(micro, dense=stats).dense_kl
    assert stats.tokens == len(turns[0].output_ids) and float(kl) == pytest.approx(0.0, abs=1e-4)


def test_the_dense_term_counts_only_taught_loss_tokens():
    """Positions without the teacher's tokens (id -1), or off the loss mask, add nothing."""
    turn = make_turn(prompt_ids=[1, 2], output_ids=[3, 4, 5], output_logprobs=[-1.0] * 3, output_versions=[0, 0, 0])
    [segment] = stitch([turn])
    top = TeacherTop(2, array.array("i", [-1, -1, -1, -1, 3, 4, -1, -1, 5, 6]), array.array("d", [NAN] * 4 + [-0.1, -3.0] + [NAN] * 2 + [-0.2, -2.5]))
    [batch] = micro_batches([Row(segment, [0.0] * 5, loss_mask=[0, 0, 1, 1, 0], teacher_top=top)], budget=64, pad_id=0)
    logp_all = torch.log_softmax(torch.zeros((1, 4, 8)), dim=-1)  # uniform over 8 tokens
    stats = DenseStats()
    kl = topk_kl(logp_all, batch, stats)
    # Only token 3 (position 2) counts: token 5 is off the mask, token 4 has no teacher.
    student = torch.log(torch.tensor([1 / 8, 1 / 8, 6 / 8]))
    teacher = torch.tensor([-0.1, -3.0, math.log(1 - math.exp(-0.1) - math.exp(-3.0))])
    assert stats.tokens == 1 and float(kl) == pytest.approx(float((student.exp() * (student - teacher)).sum()), abs=1e-5)


@pytest.mark.parametrize("forward", [False, True])
def test_the_forward_divergence_pulls_up_a_word_the_policy_never_writes(forward):
    """The teacher's likeliest token has 1e-4 of the policy's mass: the reverse KL's gradient on
    its logit is about that small, the forward one's about the teacher's probability."""
    turn = make_turn(prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0], output_versions=[0])
    [segment] = stitch([turn])
    top = TeacherTop(2, array.array("i", [-1, -1, -1, -1, 3, 4]), array.array("d", [NAN] * 4 + [math.log(0.5), math.log(0.3)]))
    [batch] = micro_batches([Row(segment, [0.0] * 3, loss_mask=[0, 0, 1], teacher_top=top)], budget=64, pad_id=0)
    logits = torch.zeros((1, 2, 8))
    logits[0, 1, 3] = -9.0  # token 3: ~1e-4 of the policy's mass
    logits.requires_grad_(True)
    kl = topk_kl(torch.log_softmax(logits, dim=-1), batch, DenseStats(), forward=forward)
    kl.backward()
    pull = -float(logits.grad[0, 1, 3])  # how hard a descent step raises token 3
    student = torch.log_softmax(logits.detach()[0, 1], dim=-1)
    teacher = torch.tensor([0.5, 0.3, 0.2]).log()
    bins = torch.cat([student[[3, 4]], torch.log(1 - student[[3, 4]].exp().sum()).view(1)])
    expected = (teacher.exp() * (teacher - bins) if forward else bins.exp() * (bins - teacher)).sum()
    assert float(kl.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert (pull > 0.45) if forward else (0 < pull < 1e-2)


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


@pytest.mark.parametrize("hinted_coef", [None, 0.0, 0.5])
def test_a_hinted_turn_takes_the_rl_term_at_its_own_weight(hinted_coef):
    """Two corrected turns (-1 each), a teacher on the first only: with `rl_coef_hinted` the first
    turn's RL advantages are weighed by it (0: the teacher's alone), the second's by `rl_coef`;
    where the reward checked the reply against the wish (practice), both by `rl_coef`."""
    first = make_turn(id="a", prompt_ids=[1, 2], output_ids=[3, 4], output_logprobs=[-1.0] * 2, output_versions=[0] * 2)
    second = make_turn(id="b", turn_index=1, prompt_ids=[1, 2, 3, 4, 9], output_ids=[5, 6, 7],
                       output_logprobs=[-1.0] * 3, output_versions=[0] * 3)
    sample = sample_of(first, -1.0)
    sample.trajectory = msgspec.structs.replace(sample.trajectory, turns=[first, second], segments=stitch([first, second]))
    sample.turn_rewards = [-1.0, -1.0]
    [segment] = sample.trajectory.segments
    teacher = [NAN] * len(segment.token_ids)
    teacher[2:4] = [-0.5, -0.5]
    sample.teacher_logprobs = [Float64s(teacher)]
    overrides = ["actor.rl_coef=0.8", "actor.opd_coef=0.0", "actor.turn_reward_coef=1.0", "actor.turn_reward_norm=none",
                 "actor.turn_discount=0.0", "train.packing=false",
                 *([] if hinted_coef is None else [f"actor.rl_coef_hinted={hinted_coef}"])]
    [[batch]] = StepBatch([group_of(sample)], load_config("configs/local.yaml", overrides), RunningBaseline(), 0).minibatches
    first_turn = 0.8 if hinted_coef is None else hinted_coef
    assert batch.advantages[0, :8].tolist() == pytest.approx([0, 0, -first_turn, -first_turn, 0, -0.8, -0.8, -0.8])
    sample.details = {"checked": ["shorter"]}  # a practice reply rewarded by a check of the wish: not the hint's -1
    [[batch]] = StepBatch([group_of(sample)], load_config("configs/local.yaml", overrides), RunningBaseline(), 0).minibatches
    assert batch.advantages[0, :8].tolist() == pytest.approx([0, 0, -0.8, -0.8, 0, -0.8, -0.8, -0.8])


@pytest.mark.parametrize("rewards, told_apart", [([0.0, 0.0, 0.0], 0.0), ([1.0, -1.0, 0.0], math.sqrt(1.5) * 2 / 3)])
def test_a_step_says_how_much_its_rewards_tell_its_samples_apart(rewards, told_apart):
    """`advantage_abs_mean`: 0 for a practice group of equal rewards, the mean |z| of checked ones."""
    samples = [sample_of(make_turn(id=f"r{i}", session_id=f"s{i}", prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0],
                                   output_versions=[0]), reward) for i, reward in enumerate(rewards)]
    group = Group("practice:s:0", 3, 0.0, 0.0, {s.id: Member(s, []) for s in samples})
    batch = StepBatch([group], load_config("configs/local.yaml", []), RunningBaseline(), 0)
    assert batch.advantage_abs_mean == pytest.approx(told_apart, rel=1e-4)


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
    config = load_config(None, ["actor.rl_coef=0", "actor.optimizer.lr=0.02", "actor.ppo_n_minibatches=1"])
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
    batch = StepBatch([group_of(sample)], config, RunningBaseline(), 0)
    [[micro]] = batch.minibatches
    with torch.no_grad():
        before = trainer.token_logprobs(micro).logp[micro.loss_mask.bool()]
    gaps = torch.tensor(teacher) - before.double()
    metrics = trainer.step(batch.minibatches, version=0)
    with torch.no_grad():
        after = trainer.token_logprobs(micro).logp[micro.loss_mask.bool()]
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
