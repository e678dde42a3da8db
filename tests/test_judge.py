"""The rule judge and the judge loop over a real NATS server: samples and unscored reports,
bounded concurrency, deadlines, failures that never stop the loop, and nothing lost."""

import asyncio

import pytest

from flywheel.bus import TRAJECTORY_SUBJECT, SessionEvent
from flywheel.config import load_config
from flywheel.judge.base import Judge, Unscorable, Verdict, outcome_of
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.rule import RuleJudge

from bus_reading import counted, judged
from factories import conversation, fb
from waiting import until


async def test_session_feedback_is_the_reward():
    judge = RuleJudge()
    one = await judge.score(conversation("a", ["x"], feedback=[fb(0.25)]))
    assert (one.reward, one.turn_rewards) == (0.25, [0.0])
    two = await judge.score(conversation("b", ["x"], feedback=[fb(1.0), fb(0.0, source="user")]))
    assert (two.reward, two.turn_rewards) == (0.5, [0.0])  # several: their mean


async def test_turn_feedback_lands_on_its_turn():
    judge = RuleJudge()
    beside_session = await judge.score(conversation("c", ["x", "y"], feedback=[fb(1.0, turn_index=1), fb(-1.0)]))
    assert (beside_session.reward, beside_session.turn_rewards) == (-1.0, [0.0, 1.0])
    alone = await judge.score(conversation("d", ["x"], feedback=[fb(3.0, turn_index=0)]))
    assert (alone.reward, alone.turn_rewards) == (3.0, [3.0])  # the only feedback: also the outcome


async def test_no_reward_means_unscorable_not_zero():
    text_only = SessionEvent(id="t", session_id="s", kind="feedback", text="meh")
    for trajectory in (conversation("a", ["x"], feedback=[text_only]), conversation("b", ["x"])):
        with pytest.raises(Unscorable) as caught:
            await RuleJudge().score(trajectory)
        assert caught.value.category == "no reward"


def test_outcome_from_turn_rewards():
    assert outcome_of([0.2, 0.4, 0.9], "mean") == pytest.approx(0.5)
    assert outcome_of([0.2, 0.4, 0.9], "last") == 0.9
    assert outcome_of([0.2, 0.4, 0.9], "min") == 0.2
    with pytest.raises(Unscorable):
        outcome_of([], "mean")


class GatedJudge(Judge):
    """Scores 0.5 per turn once `release` is set; records how many judgements ran at once."""

    name = "gated"

    def __init__(self, fail_on: str = ""):
        self.release = asyncio.Event()
        self.running = self.started = self.most_at_once = 0
        self.fail_on = fail_on

    async def score(self, trajectory):
        self.started += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            if trajectory.id == self.fail_on:
                raise RuntimeError("judge bug")
            if trajectory.id.startswith("wrong-length"):
                return Verdict(1.0, [])
            if not trajectory.id.startswith("fast"):
                await self.release.wait()
            return Verdict(0.5, [0.5] * len(trajectory.turns), {"by": "gate"})
        finally:
            self.running -= 1


@pytest.fixture
async def loop_with(nats_url, tmp_path):
    """`await loop_with(judge, *overrides)`: a started JudgeLoop using `judge`."""
    loops = []

    async def make(judge: Judge, *overrides: str) -> JudgeLoop:
        loop = JudgeLoop(load_config(None, [f"run_dir={tmp_path}", *overrides]), nats_url)
        loop.judge = judge
        await loop.start()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        await loop.stop()


async def test_judge_loop_publishes_samples_and_reports_unscored(bus, nats_url, tmp_path):
    loop = JudgeLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await loop.start()
    try:
        await bus.publish(TRAJECTORY_SUBJECT, conversation("none", ["x"]))
        await bus.publish(TRAJECTORY_SUBJECT, conversation("good", ["x"], feedback=[fb(0.75)]))
        out = await judged(bus, 2)
        sample, unscored = out["good"], out["none"]
        assert sample.reward == 0.75 and sample.judge == "rule"
        assert sample.trajectory is None and sample.trajectory_seq is not None  # a reference, not a copy
        assert await bus.resolve(sample) and sample.trajectory.turns[0].id == "good-0"
        assert sample.details == {"session_feedback": 1, "turn_feedback": 0}
        assert unscored.judge == "rule" and unscored.reason.startswith("no reward:")
        assert unscored.trajectory.turns[0].id == "none-0"
        stats = await counted(loop, 2)
        assert stats["scored"] == 1 and stats["unscored"] == 1 and stats["unscored_by_reason"] == {"no reward": 1}
    finally:
        await loop.stop()


async def test_judgements_run_concurrently_up_to_the_limit_and_fetching_goes_on(bus, loop_with):
    judge = GatedJudge()
    loop = await loop_with(judge, "judge.max_concurrency=3")
    for i in range(5):
        await bus.publish(TRAJECTORY_SUBJECT, conversation(f"slow-{i}", ["x"]))
    await until(lambda: judge.started == 3)
    await bus.publish(TRAJECTORY_SUBJECT, conversation("fast-0", ["x"]))
    assert loop.stats()["in_flight"] == 3
    judge.release.set()  # the fast one waits for room, then everything is judged
    out = await judged(bus, 6)
    assert judge.most_at_once == 3 and (await counted(loop, 6))["scored"] == 6
    assert all(s.reward == 0.5 and s.details == {"by": "gate"} for s in out.values())


async def test_a_slow_judgement_does_not_hold_up_others(bus, loop_with):
    judge = GatedJudge()
    await loop_with(judge, "judge.max_concurrency=4")
    await bus.publish(TRAJECTORY_SUBJECT, conversation("slow", ["x"]))
    await until(lambda: judge.started == 1)
    await bus.publish(TRAJECTORY_SUBJECT, conversation("fast-1", ["x"]))
    out = await judged(bus, 1)
    assert list(out) == ["fast-1"] and judge.running == 1
    judge.release.set()


async def test_deadline_failures_and_bad_verdicts_are_unscored_and_the_loop_goes_on(bus, loop_with):
    judge = GatedJudge(fail_on="buggy")
    loop = await loop_with(judge, "judge.deadline_s=0.3")
    for tid in ("slow", "buggy", "wrong-length", "fast"):
        await bus.publish(TRAJECTORY_SUBJECT, conversation(tid, ["x"]))
    out = await judged(bus, 4)
    assert out["slow"].reason == "deadline: not judged within 0.3s"
    assert out["buggy"].reason == "judge error: RuntimeError: judge bug"
    assert out["wrong-length"].reason == "invalid verdict: 0 turn rewards for 1 turns"
    assert out["fast"].reward == 0.5
    assert (await counted(loop, 4))["unscored_by_reason"] == {"deadline": 1, "judge error": 1, "invalid verdict": 1}


async def test_a_failed_publish_is_redelivered_not_lost(bus, loop_with):
    loop = await loop_with(GatedJudge())
    publish, failures = loop.bus.publish, []

    async def flaky(subject, record, **kw):
        if not failures:
            failures.append(record.id)
            raise ConnectionError("bus away")
        await publish(subject, record, **kw)

    loop.bus.publish = flaky
    await bus.publish(TRAJECTORY_SUBJECT, conversation("fast", ["x"]))
    out = await judged(bus, 1)
    assert failures == ["fast"] and out["fast"].reward == 0.5
    stats = await counted(loop, 1)
    assert stats["publish_failures"] == 1 and stats["scored"] == 1
