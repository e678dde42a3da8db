"""The session tracker and stitching: exact ids and masks, close rules, dedup; and the collect
loop over a real NATS server."""

import asyncio

from bus import SESSION_EVENT_SUBJECT, TRAJECTORY_SUBJECT, TURN_SUBJECT, SessionEvent
from collect.loop import CollectLoop
from collect.stitch import stitch
from collect.tracker import SessionTracker
from config import load_config
from tests.test_records import make_turn


def turn(tid, session="s", index=0, prompt=(1, 2), output=(3, 4), versions=None, **kw):
    return make_turn(
        id=tid, session_id=session, turn_index=index, prompt_ids=list(prompt), output_ids=list(output),
        output_logprobs=[-0.5] * len(output), output_versions=list(versions or [1] * len(output)), **kw,
    )


def test_single_turn_mask_is_one_exactly_on_sampled_tokens():
    [seg] = stitch([turn("a", prompt=[10, 11, 12], output=[20, 21], versions=[3, 4])])
    assert seg.token_ids == [10, 11, 12, 20, 21]
    assert seg.loss_mask == [0, 0, 0, 1, 1]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5]
    assert seg.versions == [-1, -1, -1, 3, 4]
    assert seg.turn_spans == [(0, 3, 5)]


def test_turns_merge_when_the_prompt_extends_and_split_when_history_is_rewritten():
    first = turn("a", index=0, prompt=[1, 2], output=[3, 4])
    second = turn("b", index=1, prompt=[1, 2, 3, 4, 5, 6], output=[7])  # extends: glue 5, 6
    third = turn("c", index=2, prompt=[1, 2, 9, 5, 6, 7, 8], output=[10])  # rewritten history
    segs = stitch([first, second, third])
    assert [s.token_ids for s in segs] == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 5, 6, 7, 8, 10]]
    assert segs[0].loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert segs[0].turn_spans == [(0, 2, 4), (1, 6, 7)]
    assert segs[1].loss_mask == [0] * 7 + [1]


def test_feedback_closes_a_session_with_its_turns_in_order():
    tracker = SessionTracker(idle_timeout_s=60)
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3, 4], output=[5]), "hb") == []
    assert tracker.add(turn("a", index=0, prompt=[1, 2], output=[3, 4]), "ha") == []
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="feedback", reward=1.0), "he")
    traj = closed.trajectory
    assert [t.id for t in traj.turns] == ["a", "b"]
    assert traj.close_reason == "feedback" and traj.feedback[0].reward == 1.0
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == [1, 2, 3, 4, 5]
    assert sorted(closed.handles) == ["ha", "hb", "he"]


def test_turn_feedback_attaches_without_closing_and_end_closes():
    tracker = SessionTracker(idle_timeout_s=60)
    tracker.add(turn("a"), 1)
    assert tracker.add(SessionEvent(id="e1", session_id="s", kind="feedback", reward=0.5, turn_index=0), 2) == []
    [closed] = tracker.add(SessionEvent(id="e2", session_id="s", kind="end"), 3)
    assert closed.trajectory.close_reason == "end"
    assert closed.trajectory.feedback[0].turn_index == 0


def test_done_turn_closes_at_once_and_duplicates_are_dropped():
    tracker = SessionTracker(idle_timeout_s=60)
    [closed] = tracker.add(turn("a", session_done=True), 1)
    assert closed.trajectory.close_reason == "done"
    [dup] = tracker.add(turn("a", session_done=True), 2)
    assert dup.trajectory is None and dup.handles == [2]
    assert tracker.counts["duplicates"] == 1


def test_end_before_turn_is_held_and_side_turns_are_not_trained():
    tracker = SessionTracker(idle_timeout_s=60)
    assert tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 1) == []
    assert tracker.add(turn("side", turn_type="side"), 2) == []
    [closed] = tracker.add(turn("main"), 3)
    assert [t.id for t in closed.trajectory.turns] == ["main"]
    assert closed.handles == [1, 2, 3]


def test_idle_sessions_expire():
    now = [0.0]
    tracker = SessionTracker(idle_timeout_s=10, clock=lambda: now[0])
    tracker.add(turn("a"), 1)
    tracker.add(SessionEvent(id="e", session_id="lonely", kind="feedback", reward=1.0, turn_index=3), 2)
    now[0] = 5.0
    assert tracker.expire() == []
    now[0] = 11.0
    closed = {c.handles[0]: c for c in tracker.expire()}
    assert closed[1].trajectory.close_reason == "idle"
    assert closed[2].trajectory is None  # feedback with no turn: nothing to train
    assert tracker.open_sessions == 0


async def test_collect_loop_publishes_trajectories_and_acks(bus, nats_url, tmp_path):
    loop = CollectLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await loop.start()
    try:
        await bus.publish(TURN_SUBJECT, turn("a", session="x", prompt=[5, 6], output=[7]))
        await bus.publish(SESSION_EVENT_SUBJECT, SessionEvent(id="e", session_id="x", kind="feedback", reward=2.0))
        consumer = bus.consumer(TRAJECTORY_SUBJECT, "check")
        got = []
        while not got:
            got = await consumer.fetch(timeout_s=5)
        traj = got[0].record
        assert traj.session_id == "x" and traj.segments[0].token_ids == [5, 6, 7]
        assert traj.segments[0].loss_mask == [0, 0, 1]
        for _ in range(100):  # acks land after the publish
            info = await bus.js.consumer_info("TRAFFIC", "collect")
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        await loop.stop()
