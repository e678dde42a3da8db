"""Signal attributed to the right tokens, at the level of records: one identity per turn, retries
and their orphans, several conversations in one session, turns the client never used, turns cut
at max_tokens, feedback that reaches every chunk of a split session, normalisation that does not
depend on arrival order. (Through the real gateway and real clients: test_attribution_live.py.)"""

from __future__ import annotations

import pytest

from flywheel.bus import Sample, SessionEvent
from flywheel.collect.tracker import SessionTracker
from flywheel.config.schema import CollectConfig
from flywheel.judge.normalize import Normalizer
from flywheel.judge.rule import RuleJudge
from flywheel.train.advantages import token_advantages

from factories import make_turn


def turn(tid, index, prompt, output, created, messages=None, response=None, **kw):
    return make_turn(
        id=tid, session_id="s", turn_index=index, prompt_ids=list(prompt), output_ids=list(output),
        output_logprobs=[-0.5] * len(output), output_versions=[1] * len(output), created_at=created,
        messages=messages if messages is not None else [{"role": "user", "content": f"m{tid}"}],
        response=response or {"role": "assistant", "content": f"r{tid}"}, **kw,
    )


def closed(turns, events=(), **config):
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0, **config))
    out = []
    for record in turns:
        out += tracker.add(record, record.id)
    for event in events:
        out += tracker.add(event, event.id)
    out += tracker.add(SessionEvent(id="end", session_id="s", kind="feedback", reward=1.0), "end")
    return [trajectory for c in out for trajectory in c.trajectories], tracker


def spans(trajectory):
    return [(position, len(seg.token_ids), start, end) for seg in trajectory.segments
            for position, start, end in seg.turn_spans]


# ---- one turn, one identity ------------------------------------------------------------------

def test_per_turn_returns_follow_each_turn_not_its_turn_index():
    """Turns [0, 1, 1'] with turn rewards [0, -1, 1]: keyed by turn_index, the last index-1 turn's
    return overwrote the first's, so the first index-1 turn was trained with the other's reward."""
    first = turn("a", 0, [1], [2], 1.0)
    second = turn("b", 1, [1, 2, 3], [4], 2.0)
    third = turn("c", 1, [1, 2, 3, 4, 5], [6], 3.0)  # a second conversation turn at index 1 (an edit)
    [trajectory], _ = closed([first, second, third])
    sample = Sample(id=trajectory.id, trajectory=trajectory, reward=0.0, judge="rule", turn_rewards=[0.0, -1.0, 1.0])
    [values] = token_advantages(sample, 0.0, coef=1.0, discount=0.0)
    sampled = {trajectory.turns[position].id: values[start] for position, _, start, _ in spans(trajectory)}
    assert sampled == {"a": 0.0, "b": -1.0, "c": 1.0}


def test_feedback_aimed_at_an_interaction_id_rewards_that_turn():
    first = turn("a", 0, [1], [2], 1.0)
    second = turn("b", 1, [1, 2, 3], [4], 2.0)
    aimed = SessionEvent(id="f", session_id="s", kind="feedback", reward=-1.0, interaction_id="a")
    [trajectory], _ = closed([first, second], [aimed])
    import asyncio

    verdict = asyncio.run(RuleJudge().score(trajectory))
    assert [t.id for t in trajectory.turns] == ["a", "b"] and verdict.turn_rewards == [-1.0, 0.0]


# ---- retries ---------------------------------------------------------------------------------

def test_a_retry_supersedes_the_answer_the_client_did_not_continue_from():
    """The openai client sends the same request again (timeout, 5xx): both answers are recorded.
    With no later turn, the later one is the one the client got; the orphan leaves training,
    counted, and is no turn's next state."""
    lost = turn("a", 0, [1, 2], [3, 4], 1.0)
    retried = turn("b", 0, [1, 2], [5, 6], 2.0)
    [trajectory], tracker = closed([lost, retried])
    assert [t.id for t in trajectory.turns] == ["b"]
    assert trajectory.segments[0].token_ids == [1, 2, 5, 6]
    assert trajectory.retry_orphans == 1 and tracker.counts["retry_orphans"] == 1


def test_the_answer_the_next_turn_continues_from_wins_over_a_later_retry():
    first = turn("a", 0, [1, 2], [3, 4], 1.0)
    retry = turn("b", 0, [1, 2], [5, 6], 2.0)  # its answer never reached the client
    follow = turn("c", 1, [1, 2, 3, 4, 7], [8], 3.0, messages=[{"role": "user", "content": "ma"},
                                                                  {"role": "assistant", "content": "ra"},
                                                                  {"role": "user", "content": "next"}])
    [trajectory], _ = closed([first, retry, follow])
    assert [t.id for t in trajectory.turns] == ["a", "c"]
    assert trajectory.segments[0].token_ids == [1, 2, 3, 4, 7, 8]
    assert trajectory.retry_orphans == 1
    assert trajectory.next_states[0] == [{"role": "user", "content": "next"}]


# ---- several conversations in one session ----------------------------------------------------

def test_each_conversation_of_a_session_is_its_own_thread_with_its_own_next_states():
    """A main agent, a sub-agent it started and a title call, interleaved under one session id:
    each turn's next state is the next turn of its own conversation."""
    main1 = turn("m1", 0, [1, 2], [3], 1.0, messages=[{"role": "user", "content": "task"}])
    sub1 = turn("s1", 0, [9, 8], [7], 2.0, messages=[{"role": "user", "content": "sub task"}])
    title = turn("t1", 0, [5, 5], [6], 3.0, messages=[{"role": "user", "content": "title?"}])
    sub2 = turn("s2", 1, [9, 8, 7, 4], [3], 4.0, messages=[{"role": "user", "content": "sub task"},
                                                          {"role": "assistant", "content": "rs1"},
                                                          {"role": "tool", "content": "files: a.py"}])
    main2 = turn("m2", 1, [1, 2, 3, 11], [12], 5.0, messages=[{"role": "user", "content": "task"},
                                                             {"role": "assistant", "content": "rm1"},
                                                             {"role": "tool", "content": "sub-agent: done"}])
    [trajectory], tracker = closed([main1, sub1, title, sub2, main2])
    ids = [t.id for t in trajectory.turns]
    assert sorted(ids) == ["m1", "m2", "s1", "s2", "t1"]  # nothing lost
    thread = dict(zip(ids, trajectory.threads))
    assert thread["m1"] == thread["m2"] != thread["s1"] == thread["s2"] != thread["t1"] != thread["m1"]
    following = dict(zip(ids, trajectory.next_states))
    assert following["m1"] == [{"role": "tool", "content": "sub-agent: done"}]
    assert following["s1"] == [{"role": "tool", "content": "files: a.py"}]
    assert following["t1"] == [] and following["m2"] == [] and following["s2"] == []
    assert len(trajectory.segments) == 3 and tracker.counts["threads"] == 3


def test_a_conversation_whose_template_rewrote_history_stays_one_thread():
    """The prompt ids do not extend the previous turn (a template that drops earlier reasoning),
    but the messages do: the same conversation, a new segment."""
    first = turn("a", 0, [1, 2], [3, 4], 1.0, messages=[{"role": "user", "content": "q"}],
                 response={"role": "assistant", "content": "ans"})
    second = turn("b", 1, [1, 2, 9, 5], [6], 2.0, messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "ans"}, {"role": "user", "content": "more"}])
    [trajectory], _ = closed([first, second])
    assert trajectory.threads == [0, 0] and len(trajectory.segments) == 2
    assert trajectory.next_states[0] == [{"role": "user", "content": "more"}]


# ---- turns the client never used; turns cut at max_tokens ------------------------------------

def test_a_turn_whose_client_went_away_is_kept_out_of_the_loss_and_counted():
    used = turn("a", 0, [1, 2], [3, 4], 1.0)
    gone = turn("b", 1, [1, 2, 3, 4, 5], [6, 7, 8], 2.0, finish_reason="abort", client_disconnected=True)
    [trajectory], tracker = closed([used, gone])
    assert [t.id for t in trajectory.turns] == ["a"]
    assert trajectory.unused_turns == 1 and tracker.counts["unused_turns"] == 1
    assert sum(seg.loss_mask.count(1) for seg in trajectory.segments) == 2


def test_an_aborted_turn_the_client_continued_from_is_context_not_loss():
    partial = turn("a", 0, [1, 2], [3, 4], 1.0, finish_reason="abort")  # the user pressed stop, then went on
    next_turn = turn("b", 1, [1, 2, 3, 4, 5], [6], 2.0)
    [trajectory], _ = closed([partial, next_turn])
    [segment] = trajectory.segments
    assert segment.token_ids == [1, 2, 3, 4, 5, 6] and segment.loss_mask == [0, 0, 0, 0, 0, 1]
    assert trajectory.masked_tokens == {"aborted": 2}


@pytest.mark.parametrize("policy, mask", [("train", [0, 0, 1, 1]), ("mask", [0, 0, 0, 0])])
def test_turns_cut_at_max_tokens_are_trained_or_masked_as_configured_and_counted(policy, mask):
    cut = turn("a", 0, [1, 2], [3, 4], 1.0, finish_reason="length")
    [trajectory], tracker = closed([cut], truncated_turns=policy)
    assert trajectory.segments[0].loss_mask == mask
    assert tracker.counts["truncated_turns"] == 1
    assert trajectory.masked_tokens == ({"truncated": 2} if policy == "mask" else {})


# ---- feedback that reaches every chunk of a split session ------------------------------------

def test_feedback_reaches_every_chunk_of_a_session_split_at_the_limit():
    turns = [turn(f"t{i}", i, list(range(1, 2 * i + 2)), [2 * i + 2], float(i)) for i in range(5)]
    trajectories, tracker = closed(turns, max_turns=2)
    assert [len(t.turns) for t in trajectories] == [2, 2, 1] and tracker.counts["limit"] == 2
    assert all(t.feedback and t.feedback[-1].reward == 1.0 for t in trajectories)
    assert len({t.id for t in trajectories}) == 3


# ---- normalisation ---------------------------------------------------------------------------

def test_normalising_a_score_does_not_use_the_score_itself():
    """Raw [1, 1, 0, 0] of one key: counting each score in its own statistics gave
    [0, 0, -0.667, -0.5]; against the scores before it, each is compared with the others."""
    normalize = Normalizer(warmup=3)
    out = [normalize("k", v) for v in (1.0, 1.0, 0.0, 0.0)]
    assert out[0] == 0.0  # nothing to compare with yet: no signal, not a made-up one
    assert out[1] == 0.0 and out[2] == pytest.approx(-1.0)
    assert out[3] == pytest.approx(-(2 / 3) / (1 / 3) ** 0.5)  # against [1, 1, 0]: mean 2/3, std 0.577


def test_per_turn_rewards_of_a_group_are_normalised_within_it_whatever_the_order():
    """The group case: four attempts at one task, one turn each, raw turn rewards [1, 1, 0, 0]
    become [1, 1, -1, -1] in the trainer, which holds the group whole, in any arrival order."""
    from flywheel.train.advantages import group_turn_rewards

    def sample(i, reward):
        [trajectory], _ = closed([turn(f"t{i}", 0, [1], [2], 1.0)])
        return Sample(id=f"x{i}", trajectory=trajectory, reward=0.0, judge="rule", turn_rewards=[reward])

    for order in ([1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]):
        normalised = group_turn_rewards([sample(i, r) for i, r in enumerate(order)])
        assert [n[0] for n in normalised] == pytest.approx([1.0 if r else -1.0 for r in order], abs=1e-5)
