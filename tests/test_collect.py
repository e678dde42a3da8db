"""The session tracker and stitching: exact ids and masks, close rules, dedup; and the collect
loop over a real NATS server."""

from flywheel.bus import (
    SESSION_EVENT_SUBJECT,
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    SessionEvent,
)
from flywheel.bus.stitch import stitch
from flywheel.collect.loop import CollectLoop
from flywheel.collect.tracker import Closed, SessionTracker
from flywheel.config import load_config
from flywheel.config.schema import CollectConfig

from bus_reading import read
from factories import make_turn
from waiting import until


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


def test_a_turn_whose_prompt_extends_the_last_one_joins_its_segment():
    first = turn("a", index=0, prompt=[1, 2], output=[3, 4])
    second = turn("b", index=1, prompt=[1, 2, 3, 4, 5, 6], output=[7])  # extends: glue 5, 6
    [seg] = stitch([first, second])
    assert seg.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert seg.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert seg.turn_spans == [(0, 2, 4), (1, 6, 7)]


def test_a_turn_that_rewrites_history_starts_a_segment_of_its_own():
    first = turn("a", index=0, prompt=[1, 2], output=[3, 4])
    rewritten = turn("c", index=1, prompt=[1, 2, 9, 5, 6, 7, 8], output=[10])  # not [1, 2, 3, 4, ...]
    segs = stitch([first, rewritten])
    assert [s.token_ids for s in segs] == [[1, 2, 3, 4], [1, 2, 9, 5, 6, 7, 8, 10]]
    assert segs[0].loss_mask == [0, 0, 1, 1]
    assert segs[1].loss_mask == [0] * 7 + [1]


def test_feedback_closes_a_session_with_its_turns_in_order():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3, 4], output=[5]), "hb") == []
    assert tracker.add(turn("a", index=0, prompt=[1, 2], output=[3, 4]), "ha") == []
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="feedback", reward=1.0), "he")
    traj = closed.trajectory
    assert [t.id for t in traj.turns] == ["a", "b"]
    assert traj.close_reason == "feedback" and traj.feedback[0].reward == 1.0
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == [1, 2, 3, 4, 5]
    assert sorted(closed.handles) == ["ha", "hb", "he"]


def test_an_end_closes_its_session():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    assert tracker.add(turn("a"), 1) == []
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 2)
    assert closed.trajectory.close_reason == "end" and [t.id for t in closed.trajectory.turns] == ["a"]
    assert closed.handles == [1, 2]


def test_turn_feedback_attaches_to_the_session_without_closing_it():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    tracker.add(turn("a"), 1)
    assert tracker.add(SessionEvent(id="e1", session_id="s", kind="feedback", reward=0.5, turn_index=0), 2) == []
    assert tracker.open_sessions == 1
    [closed] = tracker.add(SessionEvent(id="e2", session_id="s", kind="end"), 3)
    assert closed.trajectory.feedback[0].turn_index == 0 and closed.trajectory.feedback[0].reward == 0.5


def test_a_turn_marked_done_closes_its_session_at_once():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    [closed] = tracker.add(turn("a", session_done=True), 1)
    assert closed.trajectory.close_reason == "done" and tracker.open_sessions == 0


def test_a_turn_delivered_again_is_dropped_as_a_duplicate():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    tracker.add(turn("a", session_done=True), 1)
    [dup] = tracker.add(turn("a", session_done=True), 2)
    assert dup.trajectory is None and dup.handles == [2]
    assert tracker.counts["duplicates"] == 1


def test_an_end_that_arrives_before_its_turn_is_held_until_the_turn_comes():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    assert tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 1) == []
    [closed] = tracker.add(turn("main"), 2)
    assert closed.trajectory.close_reason == "end" and [t.id for t in closed.trajectory.turns] == ["main"]
    assert closed.handles == [1, 2]


def test_side_turns_are_acknowledged_but_not_trained():
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    assert tracker.add(turn("side", turn_type="side"), 1) == []
    assert tracker.add(turn("main"), 2) == []
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 3)
    assert [t.id for t in closed.trajectory.turns] == ["main"]
    assert closed.handles == [1, 2, 3]


def test_idle_sessions_expire():
    now = [0.0]
    tracker = SessionTracker(CollectConfig(idle_timeout_s=10), clock=lambda: now[0])
    tracker.add(turn("a"), 1)
    tracker.add(SessionEvent(id="e", session_id="lonely", kind="feedback", reward=1.0, turn_index=3), 2)
    now[0] = 5.0
    assert tracker.expire() == []
    now[0] = 11.0
    closed = {c.handles[0]: c for c in tracker.expire()}
    assert closed[1].trajectory.close_reason == "idle"
    assert closed[2].trajectory is None  # feedback with no turn: nothing to train
    assert tracker.open_sessions == 0


def test_a_reply_in_flight_keeps_its_session_open_past_the_idle_timeout():
    """The gateway announces a request's turns when it arrives (`pending`); a reply that takes
    longer than the idle timeout to generate must not split its conversation. A pending turn that
    never comes (its gateway died) holds the session no longer than `reply_timeout_s`."""
    now = [0.0]
    tracker = SessionTracker(CollectConfig(idle_timeout_s=10, reply_timeout_s=100), clock=lambda: now[0])
    tracker.add(turn("a"), 1)
    now[0] = 2.0
    tracker.add(SessionEvent(id="p", session_id="s", kind="pending", turn_ids=["b"]), 2)
    now[0] = 30.0  # the reply to the second request is still being generated
    assert tracker.expire() == []
    tracker.add(turn("b", index=1, prompt=(1, 2, 3, 4, 5), output=(6,)), 3)
    now[0] = 39.0
    assert tracker.expire() == []
    now[0] = 41.0
    [closed] = tracker.expire()
    assert [t.id for t in closed.trajectory.turns] == ["a", "b"] and sorted(closed.handles) == [1, 2, 3]
    assert len(closed.trajectory.segments) == 1 and closed.trajectory.close_reason == "idle"

    tracker.add(turn("c", session="gone"), 4)
    tracker.add(SessionEvent(id="q", session_id="gone", kind="pending", turn_ids=["d"]), 5)
    now[0] = 140.0
    assert tracker.expire() == []  # within reply_timeout_s of the announcement
    now[0] = 152.0
    [closed] = tracker.expire()
    assert [t.id for t in closed.trajectory.turns] == ["c"] and sorted(closed.handles) == [4, 5]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def feedback(session="s", reward=1.0, turn_index=None, eid="f"):
    return SessionEvent(id=eid, session_id=session, kind="feedback", reward=reward, turn_index=turn_index)


def test_done_waits_for_a_reward_during_the_grace_period_and_takes_stragglers():
    clock = Clock()
    tracker = SessionTracker(CollectConfig(feedback_grace_s=5), clock=clock)
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3, 4], output=[5], session_done=True), 1) == []
    assert tracker.add(turn("a", index=0, prompt=[1, 2], output=[3, 4]), 2) == []  # straggler joins
    clock.now = 4.0
    assert tracker.expire() == []
    [closed] = tracker.add(feedback(reward=0.5), 3)
    traj = closed.trajectory
    assert traj.close_reason == "done" and [t.id for t in traj.turns] == ["a", "b"]
    assert traj.feedback[0].reward == 0.5 and sorted(closed.handles) == [1, 2, 3]
    assert traj.segments[0].token_ids == [1, 2, 3, 4, 5]


def test_without_a_reward_the_session_is_emitted_when_the_grace_period_ends():
    clock = Clock()
    tracker = SessionTracker(CollectConfig(feedback_grace_s=5), clock=clock)
    tracker.add(turn("a"), 1)
    assert tracker.add(SessionEvent(id="end", session_id="s", kind="end"), 2) == []
    assert tracker.add(feedback(reward=2.0, turn_index=0, eid="t0"), 3) == []  # turn feedback: keeps waiting
    clock.now = 5.0
    [closed] = tracker.expire()
    assert closed.trajectory.close_reason == "end" and closed.trajectory.feedback[0].turn_index == 0
    assert tracker.open_sessions == 0


def test_late_feedback_is_counted_not_applied_and_acknowledged():
    tracker = SessionTracker(CollectConfig(feedback_grace_s=0))
    [closed] = tracker.add(turn("a", session_done=True), 1)
    assert closed.trajectory is not None
    [late] = tracker.add(feedback(reward=1.0), 2)
    assert late.trajectory is None and late.handles == [2]
    assert tracker.counts["late_feedback"] == 1 and tracker.open_sessions == 0


def test_turn_limit_cuts_and_later_turns_form_the_next_trajectory_emitted_together():
    tracker = SessionTracker(CollectConfig(max_turns=2, feedback_grace_s=0))
    assert tracker.add(turn("a", index=0, prompt=[1], output=[2]), 1) == []
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3], output=[4]), 2) == []  # cut here, held
    [closed] = tracker.add(turn("c", index=2, prompt=[1, 2, 3, 4, 5], output=[6], session_done=True), 3)
    first, second = closed.trajectories
    assert first.close_reason == "limit" and [t.id for t in first.turns] == ["a", "b"]
    assert [t.id for t in second.turns] == ["c"] and second.id != first.id and second.close_reason == "done"
    assert second.segments[0].loss_mask == [0, 0, 0, 0, 0, 1]
    assert tracker.counts["limit"] == 1 and sorted(closed.handles) == [1, 2, 3]


def test_a_session_two_people_share_is_a_trajectory_for_each_stretch_of_one_persons_turns():
    """ada, then bob, then ada again in one session: three trajectories, each naming its one user
    and training the adapter its turns were sampled with (not the last turn's for all of them)."""
    tracker = SessionTracker(CollectConfig(feedback_grace_s=0))
    said = [("a", "ada", "acme.u-ada"), ("b", "bob", "acme.u-bob"), ("c", "bob", "acme.u-bob"), ("d", "ada", "acme.u-ada")]
    for i, (tid, user, adapter) in enumerate(said):
        assert tracker.add(turn(tid, index=i, prompt=list(range(1, 2 * i + 2)), output=[2 * i + 2],
                                user_id=user, adapter=adapter), i) == []
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 9)
    assert [(t.user_id, t.adapter, [u.id for u in t.turns], t.close_reason) for t in closed.trajectories] == [
        ("ada", "acme.u-ada", ["a"], "user"), ("bob", "acme.u-bob", ["b", "c"], "user"), ("ada", "acme.u-ada", ["d"], "end")]
    assert len({t.id for t in closed.trajectories}) == 3 and tracker.counts["user_splits"] == 2


def test_a_late_turn_of_another_person_does_not_join_the_stretch_it_arrives_after():
    """bob's turn closes the session (done, waiting for a reward); ada's earlier turn arrives late:
    it is a stretch of its own, not bob's. A turn naming no user goes on the stretch before it."""
    tracker = SessionTracker(CollectConfig(feedback_grace_s=30))
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3], output=[4], user_id="bob", adapter="B", session_done=True), 1) == []
    assert tracker.add(turn("a", index=0, prompt=[1], output=[2], user_id="ada", adapter="A"), 2) == []
    assert tracker.add(turn("c", index=1, prompt=[1, 2, 5], output=[7], adapter="A"), 3) == []  # no user: ada's stretch
    [closed] = tracker.add(feedback(reward=1.0), 4)
    assert [(t.user_id, t.adapter, sorted(u.id for u in t.turns)) for t in closed.trajectories] == [
        ("bob", "B", ["b"]), ("ada", "A", ["a", "c"])]


def test_what_was_made_before_a_forget_never_comes_back():
    """ada is forgotten at t=10: her open session (bob's turn in it too) is dropped whole; a late
    turn of hers made before then, or of that session, is dropped as it arrives, and so is a
    trajectory of hers waiting to be published; what she says after t=10 is new, and kept."""
    tracker = SessionTracker(CollectConfig(feedback_grace_s=0))
    assert tracker.add(turn("a", session="s", user_id="ada", created_at=5.0), "h-a") == []
    assert tracker.add(turn("b", session="s", index=1, prompt=[1, 2, 3], user_id="bob", created_at=6.0), "h-b") == []
    waiting = turn("w", session="w", user_id="ada", created_at=4.0, session_done=True)
    [held] = SessionTracker(CollectConfig(feedback_grace_s=0)).add(waiting, "h-w")  # closed, not yet published
    [dropped] = tracker.forget("open", "ada", at=10.0)
    assert dropped.trajectories == [] and sorted(dropped.handles) == ["h-a", "h-b"] and tracker.open_sessions == 0
    assert tracker.forgotten.in_trajectory(held.trajectory)
    for late in (turn("c", session="s", index=2, prompt=[1, 2, 3, 4, 5], user_id="bob", created_at=9.0),
                 turn("d", session="t", user_id="ada", created_at=8.0, session_done=True)):
        assert tracker.add(late, late.id) == [Closed([], [late.id])]
    [kept] = tracker.add(turn("e", session="s", user_id="ada", created_at=11.0, session_done=True), "h-e")
    assert [t.id for t in kept.trajectory.turns] == ["e"]
    assert tracker.counts["forgotten_sessions"] == 1 and tracker.counts["forgotten_records"] == 2


def test_token_limit_counts_stitched_tokens_not_the_sum_of_prompts():
    tracker = SessionTracker(CollectConfig(max_tokens=8, feedback_grace_s=0))
    assert tracker.add(turn("a", index=0, prompt=[1, 2], output=[3, 4]), 1) == []  # 4 tokens
    assert tracker.add(turn("b", index=1, prompt=[1, 2, 3, 4, 5], output=[6]), 2) == []  # 6 stitched, bound 10
    assert tracker.add(turn("c", index=2, prompt=[1, 2, 3, 4, 5, 6, 7], output=[8]), 3) == []  # 8 stitched: cut
    [closed] = tracker.add(SessionEvent(id="e", session_id="s", kind="end"), 4)
    assert [t.close_reason for t in closed.trajectories] == ["limit"] and len(closed.trajectory.turns) == 3
    assert tracker.counts["limit"] == 1


def test_next_state_is_what_followed_each_turn_including_parallel_tool_results():
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}, {"id": "c2"}]}
    results = [{"role": "tool", "tool_call_id": "c1", "content": "4"}, {"role": "tool", "tool_call_id": "c2", "content": "9"}]
    user = {"role": "user", "content": "add them"}
    turns = [
        turn("a", index=0, prompt=[1], output=[2], messages=[user]),
        turn("b", index=1, prompt=[1, 2, 3], output=[4], messages=[user, call, *results]),
        turn("c", index=2, prompt=[1, 2, 3, 4, 5], output=[6],
             messages=[user, call, *results, {"role": "assistant", "content": "13"}, {"role": "user", "content": "thanks"}]),
    ]
    tracker = SessionTracker(CollectConfig(feedback_grace_s=0))
    for t in turns:
        tracker.add(t)
    [closed] = tracker.add(feedback())
    assert closed.trajectory.next_states == [results, [{"role": "user", "content": "thanks"}], []]


def test_thousands_of_interleaved_sessions_out_of_order_with_duplicates():
    import random

    rng = random.Random(7)
    tracker = SessionTracker(CollectConfig(feedback_grace_s=0))
    records = []
    for s in range(2000):
        prompt: list[int] = [s]
        for i in range(3):
            out = [1000 + i]
            records.append(turn(f"{s}-{i}", session=f"s{s}", index=i, prompt=list(prompt), output=out))
            prompt = prompt + out + [7]
        records.append(feedback(session=f"s{s}", reward=float(s), eid=f"f{s}"))
    turns = [r for r in records if not isinstance(r, SessionEvent)]
    events = [r for r in records if isinstance(r, SessionEvent)]
    rng.shuffle(turns)
    closed = []
    for r in turns + rng.sample(turns, 500) + events:  # every turn before its feedback, 500 redelivered
        closed += tracker.add(r)
    trajectories = [c.trajectory for c in closed if c.trajectory is not None]
    assert len(trajectories) == 2000 and tracker.counts["duplicates"] == 500
    for traj in trajectories:
        s = int(traj.session_id[1:])
        assert [t.turn_index for t in traj.turns] == [0, 1, 2] and traj.feedback[0].reward == float(s)
        [seg] = traj.segments
        assert seg.token_ids == [s, 1000, 7, 1001, 7, 1002]
        assert seg.loss_mask == [0, 1, 0, 1, 0, 1]
    assert tracker.open_sessions == 0 and tracker.counts["splits"] == 0


async def test_collect_loop_publishes_trajectories_and_acks(bus, nats_url, tmp_path):
    loop = CollectLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await loop.start()
    try:
        await bus.publish(TURN_SUBJECT, turn("a", session="x", prompt=[5, 6], output=[7]))
        await bus.publish(SESSION_EVENT_SUBJECT, SessionEvent(id="e", session_id="x", kind="feedback", reward=2.0))
        [traj] = await read(bus, TRAJECTORY_SUBJECT, "check")
        assert traj.session_id == "x" and traj.segments[0].token_ids == [5, 6, 7]
        assert traj.segments[0].loss_mask == [0, 0, 1]

        async def acknowledged():  # acks land after the publish
            info = await bus.js.consumer_info("TRAFFIC", "collect")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await until(acknowledged)
    finally:
        await loop.stop()


async def test_a_collector_stopped_cleanly_hands_its_open_sessions_to_the_next_at_once(bus, nats_url, tmp_path):
    """A stop leaves the open sessions' records unacknowledged; they used to come back only when
    their ack wait ran out, and the next collector held everything until then (flywheel train's
    --resume stood still for ~15-30 s). A clean stop now hands them back (nak) at once."""
    config = load_config(None, [f"run_dir={tmp_path}", "bus.ack_wait_s=30"])
    first = CollectLoop(config, nats_url, durable="handover")
    await first.start()
    await bus.publish(TURN_SUBJECT, turn("open-1", session="handover", prompt=[5, 6], output=[7]))
    await until(lambda: first.tracker.open_sessions > 0)
    await first.stop()

    second = CollectLoop(config, nats_url, durable="handover")
    await second.start()
    try:
        await bus.publish(SESSION_EVENT_SUBJECT, SessionEvent(id="handover-end", session_id="handover", kind="feedback", reward=1.0))
        [trajectory] = await read(bus, TRAJECTORY_SUBJECT, "handover-check", keep=lambda r: r.session_id == "handover",
                                  timeout_s=10)  # a third of the ack wait
        assert trajectory.segments[0].token_ids == [5, 6, 7] and [e.reward for e in trajectory.feedback] == [1.0]
    finally:
        await second.stop()
