"""The rule judge and the judge loop over a real NATS server."""

from bus import SAMPLE_SUBJECT, TRAJECTORY_SUBJECT, SessionEvent, Trajectory
from collect.stitch import stitch
from config import load_config
from judge.loop import JudgeLoop
from judge.rule import RuleJudge
from tests.test_collect import turn


def trajectory(tid: str, feedback: list[SessionEvent], n_turns: int = 1) -> Trajectory:
    turns = [turn(f"{tid}-{i}", index=i) for i in range(n_turns)]
    return Trajectory(id=tid, session_id=tid, segments=stitch(turns), turns=turns, feedback=feedback, close_reason="feedback")


def fb(reward, turn_index=None, source="env"):
    return SessionEvent(id=f"f{reward}{turn_index}", session_id="s", kind="feedback", reward=reward, turn_index=turn_index, source=source)


def test_session_feedback_is_the_reward_and_turn_feedback_lands_on_turns():
    judge = RuleJudge()
    assert judge.score(trajectory("a", [fb(0.25)])) == (0.25, [0.0])
    assert judge.score(trajectory("b", [fb(1.0), fb(0.0, source="user")])) == (0.5, [0.0])
    reward, turns = judge.score(trajectory("c", [fb(1.0, turn_index=1), fb(-1.0)], n_turns=2))
    assert reward == -1.0 and turns == [0.0, 1.0]
    assert judge.score(trajectory("d", [fb(3.0, turn_index=0)])) == (3.0, [3.0])


def test_no_reward_means_unscored_not_zero():
    text_only = SessionEvent(id="t", session_id="s", kind="feedback", text="meh")
    assert RuleJudge().score(trajectory("a", [text_only])) is None
    assert RuleJudge().score(trajectory("b", [])) is None


async def test_judge_loop_publishes_samples_and_counts_unscored(bus, nats_url, tmp_path):
    loop = JudgeLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await loop.start()
    try:
        await bus.publish(TRAJECTORY_SUBJECT, trajectory("none", []))
        await bus.publish(TRAJECTORY_SUBJECT, trajectory("good", [fb(0.75)]))
        consumer = bus.consumer(SAMPLE_SUBJECT, "check")
        got = []
        while not got:
            got = await consumer.fetch(timeout_s=5)
        sample = got[0].record
        assert sample.id == "good" and sample.reward == 0.75 and sample.judge == "rule"
        assert sample.trajectory.turns[0].id == "good-0"
        assert loop.stats()["unscored"] == 1 and loop.stats()["scored"] == 1
    finally:
        await loop.stop()
