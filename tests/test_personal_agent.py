"""The personal-agent bench, small: a simulated person talks to the live loops (serve, collect, the
`next_state` judge with its hint teacher on the pinned server, train) through the official
`openai` client with nothing but `X-Session-Id`; their correction becomes the first reply's next
state, the judge's verdict and hint, the teacher's log-probs on exactly that reply's tokens, and
a training step whose version is swapped in. Also the bench's numbers on known sequences and the
preference rules on known replies."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from flywheel.bus import SAMPLE_SUBJECT, Sample, Trajectory
from flywheel.bus.instructions import Instructions
from flywheel.bus.streams import memory_subject
from flywheel.collect.loop import CollectLoop
from flywheel.config import load_config
from flywheel.config.memory import MemoryConfig
from flywheel.deploy.deployment import sharing_cores, side_server_config
from flywheel.drills.personal_agent import (
    CONFIG,
    Asked,
    all_taken,
    converse,
    judge_agreement,
    rolling_rate,
    served_instructions,
    sessions_to_learn,
    summary_rows,
    verdicts,
    version_of,
    with_memory,
)
from flywheel.drills.simulated_people import (
    OFF_TOPIC,
    PREFERENCES,
    TRAIN_QUESTIONS,
    User,
    Voice,
    answers,
    people_from,
)
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.wishes import ASPECTS
from flywheel.serve.loop import ServeLoop
from flywheel.train.loop import TrainLoop

from bus_reading import read
from waiting import until


async def test_a_persons_correction_is_judged_taught_and_trained(nats_url, tmp_path, bus):
    config = load_config(CONFIG, [f"run_dir={tmp_path}", "model=tiny", "collect.idle_timeout_s=1.5"])
    config = sharing_cores(config)  # the loops share this machine, as in a Deployment
    assert config.judge.kind == "next_state" and config.train.batch_size == 1 and not config.rollout.enabled
    judge_server = ServeLoop(side_server_config(config, "judge"), nats_url)
    loops = [ServeLoop(config, nats_url), judge_server, CollectLoop(config, nats_url), JudgeLoop(config, nats_url),
             TrainLoop(config, nats_url)]
    for loop in loops:
        await loop.start()
    serve, train = loops[0], loops[-1]
    # "name": the untrained tiny model never writes "Maya"; every correction is a specific one (a hint);
    # tiny's replies answer nothing, so only their form counts here.
    # In the second session the person also reacts to the second reply (the bench's --reactions 2).
    user = User("Maya", PREFERENCES["name"], seed=3, vague_share=0.0, wants_answers=False)
    try:
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
        sessions = []
        for s, reactions in enumerate((1, 2)):
            app = SimpleNamespace(max_tokens=12, temperature=1.0, reactions=reactions)
            sessions.append(await asyncio.to_thread(converse, client, serve.model_name, user, s, "t", app))
            await until(lambda: train.stats()["samples"] == s + 1 and serve.pool.weight_version == train.version, 90)
        said = await verdicts(nats_url)
        samples = await read(bus, SAMPLE_SUBJECT, "check", 2, lambda r: isinstance(r, Sample))
        for sample in samples:
            assert await bus.resolve(sample)
    finally:
        for loop in reversed(loops):
            await loop.stop()
    assert [s["version"] for s in sessions] == [0, 1]  # the second session was answered by the trained weights
    assert [s["question"] for s in sessions] == [user.question(0), user.question(1)] and set(TRAIN_QUESTIONS) >= {
        s["question"] for s in sessions}
    assert not any(s["satisfied"] for s in sessions) and "said_again" not in sessions[0]
    assert not sessions[1]["second_satisfied"] and sessions[1]["said_again"] in {t.format(name="Maya") for t in PREFERENCES["name"].specific}
    by_session = {sample.trajectory.session_id: sample for sample in samples}
    for session in sessions:
        sample, trajectory = by_session[session["id"]], by_session[session["id"]].trajectory
        corrections = [session["said"], *([session["said_again"]] if "said_again" in session else [])]
        assert corrections[0] in {t.format(name="Maya") for t in PREFERENCES["name"].specific}
        judged = len(corrections)  # the last reply has nothing after it
        for turn, correction in enumerate(corrections):
            assert trajectory.next_states[turn] == [{"role": "user", "content": correction}]  # the person's words, as said
            verdict = sample.details["turns"][turn]
            assert verdict["class"] == "correction" and verdict["source"] == "next_state" and verdict["hint"] == correction  # whole
            assert sample.turn_rewards[turn] == -1.0
        assert sample.details["unjudged_turns"] == [judged]
        [segment], [teacher] = trajectory.segments, sample.teacher_logprobs
        assert len(segment.turn_spans) == judged + 1
        taught = [i for _, start, end in segment.turn_spans[:judged] for i in range(start, end)]
        assert [i for i, v in enumerate(teacher) if not math.isnan(v)] == taught  # the judged replies, only
        k, [top_ids] = sample.teacher_top_k, sample.teacher_top_ids  # and the teacher's 20 likeliest tokens there
        assert k == config.judge.teacher.top_k == 20 and [t for t in range(len(teacher)) if top_ids[t * k] >= 0] == taught
        turns = sample.details["turns"]
        assert said[session["id"]] == {"judge_class": "correction", "judge_score": -1, "hint": turns[0]["hint"], "teacher_tokens": len(taught),
                                       **({"second_class": "correction", "second_score": -1, "second_hint": turns[1]["hint"]}
                                          if judged == 2 else {})}
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["n_samples"]) for m in metrics] == [(1, 1), (2, 1)]
    assert all(m["opd_topk_tokens"] > 0 and m["opd_topk_kl"] > 0 for m in metrics)  # the bench distils densely
    assert judge_server.pool.weight_version == 0  # the teacher never moved


def test_sessions_to_learn_counts_to_the_third_of_the_first_three_in_a_row():
    t, f = True, False
    assert sessions_to_learn([t, t, t]) == 3
    assert sessions_to_learn([f, t, t, f, t, t, t, f, t]) == 7
    assert sessions_to_learn([t, t, f, t, t, f, t, t]) is None
    assert sessions_to_learn([]) is None
    assert sessions_to_learn([f, t, t], run=2) == 3
    assert rolling_rate([f, t, t, t, t, t, f], window=5) == pytest.approx([0, 1 / 2, 2 / 3, 3 / 4, 4 / 5, 1, 4 / 5])
    assert version_of("flywheel-v12") == 12 and version_of(None) is None and version_of("fp_x") is None


def test_judge_agreement_is_the_share_of_judged_sessions_it_read_right():
    sessions = [{"satisfied": False, "judge_score": -1}, {"satisfied": True, "judge_score": 1},
                {"satisfied": True, "judge_score": -1}, {"satisfied": False}]  # the last one not judged
    assert judge_agreement(sessions) == pytest.approx(2 / 3)
    assert judge_agreement([{"satisfied": True}]) is None


def test_the_summary_table_has_a_row_per_arm_with_its_trials_numbers():
    def trial(arm, learned, rate, heldout, arith=None):
        return {"arm": arm, "pref": "brief", "learned_at": learned, "cap": 30, "satisfied_rate": rate,
                "heldout": {"rate": heldout, "answers": 1.0}, "judge_agreement": 1.0, "arith_after": arith}

    rows = summary_rows([trial("both", 7, 0.5, 0.6, 0.3), trial("both", 11, 0.4, 0.5, 0.2), trial("none", None, 0.1, 0.1),
                         trial("both", 9, 0.3, 0.4, 0.1), trial("none", 20, 0.2, 0.1)], arith_before=0.25)
    none, both = rows  # arms in their fixed order: none, rl, opd, both
    assert none[:6] == ["none", "brief", 2, ">30 20", ">25", "1/2"]  # one that never learned: more than the cap, so the median more than 25
    assert both[:6] == ["both", "brief", 3, "7 11 9", 9, "3/3"]
    assert both[6:] == pytest.approx([0.4, None, 0.5, None, 1.0, 1.0, 0.25, 0.2])  # no held-out "before" measured here
    assert none[12:] == [0.25, None]
    two = summary_rows([trial("both", 7, 0.5, 0.6), {**trial("both", None, 0.2, 0.1), "pref": "name"}], arith_before=None)
    assert [row[:6] for row in two] == [["both", "brief", 1, "7", 7, "1/1"], ["both", "name", 1, ">30", ">30", "0/1"],
                                        ["both", "all", 2, "7 >30", ">18.5", "1/2"]]  # the median of 7 and more than 30


@pytest.mark.parametrize("kind, meets, misses", [
    ("brief", "Water it when the top inch is dry, and give it bright light.", " ".join(["word"] * 31)),
    ("bullets", "- Water lightly\n- Sunny window\n- Pinch the flowers", "Water it lightly and keep it in the sun."),
    ("name", "Maya, water it every other day.", "Water it every other day; Mayan calendars aside."),
    ("answer_first", "Boil it for six minutes. Then cool it in cold water.", "Great question! There are many ways to do it."),
    ("plain", "Water it lightly and keep it in the sun.", "**Water** it lightly.\n# Light"),
    ("formal", "It is advisable to water the plant weekly.", "Hey, don't worry, it's super easy!"),
    ("detailed", " ".join(["word"] * 40), "Water it when the top inch is dry, and give it bright light."),
    ("no_name", "Water it every other day.", "Maya, water it every other day."),
    ("nickname", "Sure thing, Captain: water it every other day.", "Water it every other day, Maya; captains' logs aside."),
    ("steps", "\nStep 1: Fill the pot.\nStep 2: Water it.", "Fill the pot.\nStep 1: water it."),
])
def test_each_preference_rule_on_known_replies(kind, meets, misses):
    rule = PREFERENCES[kind].rule
    assert rule(meets, "Maya") and not rule(misses, "Maya")


def test_a_person_corrects_a_miss_and_otherwise_thanks_or_moves_on():
    user = User("Omar", PREFERENCES["name"], seed=1)
    miss = [user.react(f"{user.question(s)} Do it daily.", s) for s in range(40)]
    corrections = {said for said, _ in miss}
    assert corrections <= {t.format(name="Omar") for t in (*PREFERENCES["name"].specific, *PREFERENCES["name"].vague)}
    assert len(corrections) > 3  # varied phrasings, specific and vague
    assert [asked for _, asked in miss] == [user.question(s) for s in range(40)]  # the next reply answers the same question
    happy = [user.react(f"Omar, {user.question(s)} Do it daily.", s) for s in range(40)]
    assert not {said for said, _ in happy} & corrections
    new = [(s, said, asked) for s, (said, asked) in enumerate(happy) if asked is not None]
    assert 0 < len(new) < len(happy)  # thanks (nothing more to answer) or a new question to answer next
    assert all(asked != user.question(s) and asked[1:] in said for s, said, asked in new)
    # Told not to ask more (its reaction to a second reply), a satisfied person only thanks.
    assert {user.react(f"Omar, {user.question(s)} Do it daily.", s, ask=False)[1] for s in range(20)} == {None}
    # No answer at all (nonsense that happens to use the name) is no success, whatever its form.
    assert {user.react("You are Omar's personal assistant.", s)[0] for s in range(10)} <= set(OFF_TOPIC)
    assert not user.satisfied("You are Omar's personal assistant.", user.question(0))


def test_an_answer_speaks_of_the_question_and_is_not_one_word_over_and_over():
    assert answers("How do I descale a kettle?", "Boil vinegar in the kettle, then rinse it.")
    assert answers("How can I remember people's names better?", "Repeat each name when you hear it.")
    assert not answers("How do I remove a splinter?", "You are Pre-cut Your Hair.")
    assert not answers("How do I fix a squeaky door?", "door " * 10)


def test_a_person_written_elsewhere_speaks_only_in_their_own_words():
    voice = Voice(corrections=("Too long for me.", "Shorter, please."), off_topic=("That is not what I asked.",),
                  thanks=("Lovely.",), new_question=("Another one: {question}",))
    user = User("Ada", PREFERENCES["brief"], seed=1, voice=voice)
    question = user.question(0)
    assert {user.react(" ".join([question] * 5), 0)[0] for _ in range(20)} <= set(voice.corrections)
    assert {user.react("You are Ada's personal assistant.", 0)[0] for _ in range(5)} == {"That is not what I asked."}
    said = {user.react(f"{user.question(s)} Daily.", s)[0] for s in range(20)}
    assert "Lovely." in said and any(line.startswith("Another one: ") for line in said) and len(said) > 2


@pytest.mark.parametrize("file", ["people_heldout.json", "people_heldout_2.json"])
def test_the_blind_people_files_are_well_formed(file):
    """bench/data/people_heldout*.json: three people for each of four preferences, every list long
    enough, every new-question line with one place for the question. Checked without showing a
    line of theirs (the judge's author does not read them)."""
    people = people_from(Path(__file__).resolve().parent.parent / "bench" / "data" / file)
    assert sorted(people) == sorted(f"{pref}-{i}" for pref in ("brief", "bullets", "name", "formal") for i in (1, 2, 3))
    for key, (name, preference, voice) in people.items():
        fits = (key.startswith(preference.kind) and bool(name) and len(voice.corrections) >= 14 and len(voice.off_topic) >= 4
                and len(voice.thanks) >= 6 and len(voice.new_question) >= 6
                and all(line.count("{question}") == 1 and line.format(question="Q?").count("Q?") == 1
                        for line in voice.new_question))
        assert fits, key


def test_the_memory_baseline_keeps_the_words_or_what_they_ask_for():
    hints = ["way too long for my phone", "Canberra is the capital, not Sydney.", "shorter!! I said shorter"]
    worded = with_memory("You are Ada's personal assistant.", "Ada", hints)
    assert worded.endswith(" ".join(f'"{hint}"' for hint in hints))
    assert with_memory("S.", "Ada", hints, "instead") == f"S. What Ada has told you about how they like replies: {ASPECTS['shorter']}"
    assert with_memory("S.", "Ada", [], "instead") == "S."


async def test_the_bench_asks_held_out_questions_with_what_the_gateway_serves_that_person(nats_url, bus):
    """The held-out replies of a served-memory trial are asked with the person's newest
    instructions, as the gateway puts them; the person who names no user id is one person."""
    def record(user: str | None, said: list[str], k: int) -> Instructions:
        return Instructions(id=f"{user}-{k}", tenant="open", user_id=user, instructions=said, read=[], turns=[], read_from=k)

    await bus.publish(memory_subject("open", None), record(None, [ASPECTS["shorter"]], 0))
    await bus.publish(memory_subject("open", None), record(None, [ASPECTS["list"], ASPECTS["formal"]], 1))
    await bus.publish(memory_subject("open", "maya"), record("maya", [ASPECTS["name"]], 2))
    assert await served_instructions(nats_url) == [ASPECTS["list"], ASPECTS["formal"]]
    assert await served_instructions(nats_url, "maya") == [ASPECTS["name"]]
    assert await served_instructions(nats_url, "tomas") == []
    in_system = MemoryConfig(template="\n\nAsked: $instructions")
    assert Asked("S.", ("A.", "B."), in_system).chat("Q?") == [
        {"role": "system", "content": "S.\n\nAsked: A. B."}, {"role": "user", "content": "Q?"}]
    assert Asked("S.", ("A.",), MemoryConfig(placement="user")).chat("Q?") == [
        {"role": "system", "content": "S."}, {"role": "user", "content": "A.\n\nQ?"}]
    assert Asked("S.", (), in_system).chat("Q?") == [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"}]


async def test_a_sessions_verdict_is_its_own_samples_not_its_practices(nats_url, bus):
    """Practice samples share their session's id (flywheel/judge/practice.py) and carry no verdict:
    the bench's record of what the judge said of a session is its own sample's, whichever comes last."""
    def sample(id: str, judge: str, details: dict) -> Sample:
        trajectory = Trajectory(id=id, session_id="s1", segments=[], turns=[], close_reason="end")
        return Sample(id=id, trajectory=trajectory, reward=-1.0, judge=judge, details=details)

    await bus.publish(SAMPLE_SUBJECT, sample("s1", "next_state", {"turns": [{"class": "correction", "score": -1.0}]}))
    await bus.publish(SAMPLE_SUBJECT, sample("s1:practice:0:0", "practice", {"practice_of": "s1", "turn": 0}))
    said = await verdicts(nats_url)
    assert said["s1"]["judge_class"] == "correction" and said["s1"]["judge_score"] == -1.0


def test_the_next_session_waits_for_its_practice_samples_to_be_trained():
    """With practice the judge publishes a session's own sample and its practice samples: the bench
    starts the next session once the trainer has taken all of them (trained or dropped), not as many
    samples as sessions (the next first reply would come of a version that has not learned from the
    last correction, and the practice samples still waiting go stale)."""
    practice = {"turns": 2, "samples": 8, "failures": 0}
    judged = {"scored": 2, "unscored": 0, "practice": practice}
    assert all_taken(judged, {"samples": 9, "stale_dropped": 1})
    assert not all_taken(judged, {"samples": 9})
    assert all_taken({**judged, "practice": None}, {"samples": 2})  # no practice: the sessions' own
