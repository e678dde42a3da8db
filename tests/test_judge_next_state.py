"""The `next_state` rule judge on real trajectories (stitched by the collector's SessionTracker):
corrections, thanks, tool tracebacks and test summaries as per-turn rewards, hints from
corrections, turns with nothing after them left unjudged, session and per-turn feedback, the kind
built from config (alone and as a composite component), and its accuracy on the labelled set."""

from __future__ import annotations

import pytest

from flywheel.bus import SessionEvent
from flywheel.collect.tracker import SessionTracker
from flywheel.config import load_config
from flywheel.config.judge import NextStateJudgeConfig
from flywheel.config.schema import CollectConfig
from flywheel.judge.base import Unscorable
from flywheel.judge.build import build_judge
from flywheel.judge.composite import CompositeJudge
from flywheel.judge.evaluation import evaluate, load_examples
from flywheel.judge.next_state import NextStateJudge, hint_for, request_text
from flywheel.judge.next_state_classes import LABELS, polarity
from flywheel.judge.next_state_rules import classify_user_text
from flywheel.judge.next_state_tool_output import classify_tool_output

from factories import make_turn

CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"pytest\"}"}}


def session(exchanges, events=(), sid="s"):
    """The trajectory of one session: each exchange is (the messages sent before the turn: the
    user's words or tool results, the assistant's reply). Token ids continue exactly, turn by
    turn, as the gateway records them; the session ends with an explicit end."""
    tracker = SessionTracker(CollectConfig(idle_timeout_s=60, feedback_grace_s=0))
    messages, prompt, closed = [], [], []
    for k, (incoming, reply) in enumerate(exchanges):
        messages = messages + incoming
        prompt = prompt + [100 + k] * len(incoming)
        output = [200 + k, 300 + k]
        turn = make_turn(id=f"{sid}-{k}", session_id=sid, turn_index=k, messages=list(messages), response=reply,
                         prompt_ids=list(prompt), output_ids=output, output_logprobs=[-0.5, -0.5], output_versions=[1, 1],
                         created_at=float(k))
        closed += tracker.add(turn, turn.id)
        messages, prompt = messages + [reply], prompt + output
    for event in [*events, SessionEvent(id=f"{sid}-end", session_id=sid, kind="end")]:
        closed += tracker.add(event, event.id)
    [trajectory] = [t for c in closed for t in c.trajectories]
    return trajectory


def user(text):
    return [{"role": "user", "content": text}]


def said(text):
    return {"role": "assistant", "content": text}


def feedback(sid="s", **fields):
    return SessionEvent(id=f"f-{sorted(fields.items())}", session_id=sid, kind="feedback", **fields)


async def test_a_correction_scores_minus_one_with_its_hint_and_thanks_plus_one():
    trajectory = session([
        (user("Write a function that returns the largest number in a list."), said("def largest(xs):\n    return min(xs)")),
        (user("No, that returns the smallest one. Use max."), said("def largest(xs):\n    return max(xs)")),
        (user("thanks!"), said("You're welcome.")),
    ])
    assert [t.id for t in trajectory.turns] == ["s-0", "s-1", "s-2"]
    verdict = await NextStateJudge().score(trajectory)
    verdict.check(trajectory)
    assert verdict.turn_rewards == [-1.0, 1.0, 0.0]
    first, second, last = verdict.details["turns"]
    assert (first["class"], first["source"]) == ("correction", "next_state")
    assert first["hint"] == "No, that returns the smallest one. Use max."  # the learned reader's hint: the whole reaction
    assert second["class"] == "thanks" and "hint" not in second
    assert last["class"] is None and verdict.details["unjudged_turns"] == [2]
    assert verdict.reward == 0.0 and verdict.details["outcome_from"] == "judged turns"  # mean of -1 and +1


def test_the_hint_is_the_users_instruction_and_only_corrections_have_one():
    assert hint_for("Thanks, but I asked for TypeScript. Add types.") == "I asked for TypeScript. Add types."
    assert hint_for("hmm, I meant the other file - utils.py, not x.py") == "I meant the other file - utils.py, not x.py"
    assert hint_for("thanks, but use the logging module") == "use the logging module"
    assert hint_for("Not quite - start at 0.") == "start at 0."
    for not_a_correction in ("thanks!", "no worries, that's perfect", "still broken", "Why doesn't the sky fall down?"):
        assert hint_for(not_a_correction) is None


@pytest.mark.parametrize("said", ["Huh, that has nothing to do with what I asked.", "This has nothing to do with my question.",
                                  "That had nothing to do with what I said"])
def test_a_reply_off_the_question_draws_a_complaint_not_a_hint(said):
    """"Nothing to do with what I asked" says the reply missed, not how to do better. Read as a
    hint ("I asked" is a correction cue), it told the hint teacher to expect an apology, and hint
    distillation taught a personal agent to apologise instead of answering (docs/benchmarks.md 17e)."""
    assert classify_user_text(said).label == "complaint"
    assert hint_for(said) is None
    assert hint_for(f"{said} I asked how to boil an egg.").endswith("I asked how to boil an egg.")  # now it says how


async def test_a_traceback_scores_minus_one_and_passing_tests_plus_one():
    traceback = ("Traceback (most recent call last):\n  File \"parse.py\", line 3, in <module>\n"
                 "    parse(None)\nAttributeError: 'NoneType' object has no attribute 'split'")
    calling = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    trajectory = session([
        (user("Fix the parser and run the tests"), calling),
        ([{"role": "tool", "tool_call_id": "c1", "content": traceback}], calling),
        ([{"role": "tool", "tool_call_id": "c1", "content": "======= 5 passed in 0.10s ======="}], said("Fixed; all green.")),
    ])
    verdict = await NextStateJudge().score(trajectory)
    assert verdict.turn_rewards == [-1.0, 1.0, 0.0]
    assert [t["class"] for t in verdict.details["turns"]] == ["error", "tests_passing", None]
    assert verdict.details["unjudged_turns"] == [2]


@pytest.mark.parametrize("output, label", [
    ("3 passed, 1 failed in 0.45s", "tests_failing"),
    ("FAILED tests/test_x.py::test_y - AssertionError", "tests_failing"),
    ("Results: 12 tests, 0 failed, 0 errors", "tests_passing"),
    ("==== 20 passed, 2 xfailed in 3.1s ====", "tests_passing"),
    ("collected 0 items\n\n==== no tests ran in 0.01s ====", "unclear"),
    ("src/log.py:12:def log_error(msg):\nsrc/log.py:30:    raise ValueError('no handler')", "clean_tool_result"),
    ("bash: pyhton: command not found\n[exit code: 127]", "error"),
    ("main.c:5:12: error: expected ';' before 'return'", "error"),
    ('{"ok": false, "error": "File not found"}', "error"),
    ("", "clean_tool_result"),
])
def test_tool_output_is_read_for_structure_not_words(output, label):
    assert classify_tool_output(output).label == label


async def test_a_turn_with_nothing_after_it_and_no_feedback_is_not_judged():
    with pytest.raises(Unscorable) as caught:
        await NextStateJudge().score(session([(user("hi"), said("hello"))]))
    assert caught.value.category == "nothing followed"
    verdict = await NextStateJudge().score(session([(user("What's 2+2?"), said("4")), (user("perfect"), said("Glad to help."))]))
    assert verdict.turn_rewards == [1.0, 0.0] and verdict.details["unjudged_turns"] == [1]


async def test_a_reaction_the_judge_cannot_read_leaves_its_turn_unjudged():
    """'hmm' is unclear: its turn is kept out of the loss and of the outcome (as a 0 it would be
    a positive advantage against a baseline of corrections); alone it leaves nothing to score."""
    verdict = await NextStateJudge().score(session([(user("What's 2+2?"), said("4")), (user("hmm"), said("It is 4.")),
                                                    (user("perfect"), said("Glad to help."))]))
    assert [t["class"] for t in verdict.details["turns"]] == ["unclear", "acceptance", None]
    assert verdict.details["unjudged_turns"] == [0, 2] and verdict.reward == 1.0
    with pytest.raises(Unscorable):
        await NextStateJudge().score(session([(user("What's 2+2?"), said("4")), (user("hmm"), said("It is 4."))]))


async def test_session_feedback_gives_the_outcome_and_the_turns_nothing_followed():
    exchanges = [(user("Write a haiku"), said("Leaves fall...")), (user("Now one about winter."), said("Snow..."))]
    verdict = await NextStateJudge().score(session(exchanges, [feedback(reward=0.5)]))
    assert verdict.reward == 0.5 and verdict.turn_rewards == [1.0, 0.5]
    assert verdict.details["unjudged_turns"] == [] and verdict.details["turns"][1]["source"] == "session_feedback"
    only = await NextStateJudge().score(session([(user("hi"), said("hello"))], [feedback(text="great, thanks")]))
    assert (only.reward, only.turn_rewards) == (1.0, [1.0])


async def test_feedback_about_a_turn_is_used_for_that_turn():
    exchanges = [(user("What's the API's max batch size?"), said("1000 items.")),
                 (user("ok next: write the README"), said("# Project\n...")),
                 (user("thanks"), said("Anytime."))]
    aimed = feedback(interaction_id="s-0", text="this was wrong, the limit is 100 not 1000")
    by_index = feedback(turn_index=1, reward=-2.0)
    elsewhere = feedback(interaction_id="another-piece", reward=5.0)
    verdict = await NextStateJudge().score(session(exchanges, [aimed, by_index, elsewhere]))
    first, second, _ = verdict.details["turns"]
    assert verdict.turn_rewards == [-1.0, -1.0, 0.0]  # without feedback the next states say +1, +1
    assert (first["score"], first["source"], first["hint"]) == (-1, "feedback", aimed.text)
    assert (second["class"], second["cue"]) == ("rated", "feedback reward -2")
    assert verdict.reward == -1.0 and verdict.details["unjudged_turns"] == [2]


async def test_the_kind_builds_from_config_alone_and_as_a_composite_component(tmp_path):
    judge = build_judge(load_config(None, [f"run_dir={tmp_path}", "judge.kind=next_state", "judge.next_state.retry_overlap=0.8"]))
    assert isinstance(judge, NextStateJudge) and judge.config.retry_overlap == 0.8
    composite = build_judge(load_config(None, [
        f"run_dir={tmp_path}", "judge.kind=composite",
        "judge.composite.components=[{kind: next_state, weight: 0.5}, {kind: rule, required: false}]",
    ]))
    assert isinstance(composite, CompositeJudge) and isinstance(composite.components[0].judge, NextStateJudge)
    verdict = await composite.score(session([(user("Sort this list"), said("sorted(xs)")), (user("thx"), said(":)"))]))
    assert verdict.turn_rewards == [0.5, 0.0] and verdict.reward == 0.5 and list(verdict.details["skipped"]) == ["1:rule"]


def test_the_labelled_set_is_well_formed():
    examples = load_examples()
    assert len(examples) >= 120 and len({e["id"] for e in examples}) == len(examples)
    for e in examples:
        assert e["gold"] in LABELS and e["polarity"] == polarity(e["gold"]) and e["split"] in ("dev", "heldout", "fresh")
        assert e["next"] and all(m["role"] in ("user", "tool") for m in e["next"])
    heldout = sum(e["split"] == "heldout" for e in examples) / sum(e["split"] != "fresh" for e in examples)
    assert heldout == pytest.approx(0.3, abs=0.01)


async def test_accuracy_does_not_regress_below_what_docs_report():
    """docs/judges.md reports (frozen rules): held-out 98 % class and polarity accuracy, fresh
    (written after the rules were frozen) 76 % class, 80 % polarity; the keyword baseline 45 % /
    55 % and 39 % / 45 %. A small margin for one example's worth of change."""
    result = await evaluate(config=NextStateJudgeConfig(reader="rules"))
    for split, class_accuracy, polarity_accuracy in (("heldout", 0.98, 0.98), ("fresh", 0.755, 0.795)):
        judge, keyword = result[split]["judge"], result[split]["keyword"]
        assert judge["class_accuracy"] >= class_accuracy - 0.03, split
        assert judge["polarity_accuracy"] >= polarity_accuracy - 0.03, split
        assert judge["polarity_accuracy"] > keyword["polarity_accuracy"] + 0.2, split


def test_the_request_is_read_in_the_persons_words_without_the_served_instructions():
    """What a reply answered, as the reaction reader compares a reaction with it: the first user
    message without the instructions the served memory put before it (`Turn.instructions`); a later
    message as the person wrote it, even when it says the same words as an instruction."""
    asked = [{"role": "user", "content": "Answer in one short sentence.\n\nHow do tides work?"}]
    assert request_text(make_turn(messages=asked, instructions=["Answer in one short sentence."])) == "How do tides work?"
    assert request_text(make_turn(messages=asked)) == asked[0]["content"]  # none served: all of it is theirs
    later = [*asked, {"role": "assistant", "content": "The moon."},
             {"role": "user", "content": "Answer in one short sentence.\n\nAnd waves?"}]
    assert request_text(make_turn(messages=later, instructions=["Answer in one short sentence."])) == later[-1]["content"]
