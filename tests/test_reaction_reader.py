"""The learned reader of people's words after a reply (flywheel/judge/reaction_reader.py), as the
`next_state` judge uses it by default: reactions in words nobody listed are read, and the whole
reaction is the hint; new requests and approval are not hints; the rules stay one setting away.
How well it reads on words its author never saw: bench/judge_reactions.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.bus import Trajectory, Turn
from flywheel.config.judge import NextStateJudgeConfig
from flywheel.judge.base import Unscorable
from flywheel.judge.evaluation import unseen
from flywheel.judge.hashed_classifier import FILE, HashedLinear, text_features, trained_once
from flywheel.judge.next_state import NextStateJudge
from flywheel.judge.reaction_reader import (
    READ_LABELS,
    ReactionReader,
    reader,
    training_set,
)
from flywheel.judge.wishes import wish_reader

QUESTION = "How do I keep basil alive on a windowsill?"
REPLY = ("Basil loves light! Water it often, pinch the tops, and keep it warm. It's a great herb for beginners and "
         "grows fast in summer, so enjoy it in pasta, salads and pesto all year.")


def reacted(said: str) -> Trajectory:
    turn = Turn(id="t0", session_id="s", turn_index=0, model="m", messages=[{"role": "user", "content": QUESTION}],
                response={"role": "assistant", "content": REPLY}, prompt_ids=[], output_ids=[], output_logprobs=[],
                output_versions=[], finish_reason="stop")
    return Trajectory(id="s", session_id="s", segments=[], turns=[turn], next_states=[[{"role": "user", "content": said}]],
                      close_reason="done")


@pytest.mark.parametrize("said", [
    "You didn't use my name, I'm Maya.",
    "I was kind of hoping for a list I could skim.",
    "next time just the short version pls",
    "Bit much for my phone screen, honestly.",
])
async def test_a_reaction_in_words_no_rule_lists_is_read_and_is_the_hint_whole(said):
    """The rules read each of these as a complaint without a hint, as unclear, or as moving on."""
    [entry] = (await NextStateJudge().score(reacted(said))).details["turns"]
    assert entry["class"] in ("correction", "complaint") and entry["score"] == -1 and entry["hint"] == said
    with contextlib.suppress(Unscorable):  # read as unclear by the rules: nothing to score, so no hint
        [ruled] = (await NextStateJudge(NextStateJudgeConfig(reader="rules")).score(reacted(said))).details["turns"]
        assert "hint" not in ruled


@pytest.mark.parametrize("said, label", [
    ("Could you also tell me how to descale a kettle?", "moving_on"),
    ("Great, and what about mint?", "moving_on"),
    ("Lovely, that is exactly it.", "acceptance"),
    ("thank you so much!!", "thanks"),
])
async def test_new_requests_and_approval_score_plus_one_without_a_hint(said, label):
    [entry] = (await NextStateJudge().score(reacted(said))).details["turns"]
    assert (entry["class"], entry["score"]) == (label, 1) and "hint" not in entry


async def test_the_rules_are_one_setting_away_with_their_trimmed_hint():
    judge = NextStateJudge(NextStateJudgeConfig(reader="rules"))
    [entry] = (await judge.score(reacted("No, shorter please: two sentences."))).details["turns"]
    assert (entry["class"], entry["hint"]) == ("correction", "shorter please: two sentences.")


def test_every_process_trains_the_same_reader():
    """Judges on several machines must read alike: training is deterministic."""
    again = ReactionReader(training_set())
    for said in ("too long", "thanks, and how do I prune it?", "que?"):
        assert again.probabilities(said, QUESTION, REPLY) == reader().probabilities(said, QUESTION, REPLY)


def test_a_judge_reads_with_the_machines_readers_and_never_imports_torch():
    """Reading is numpy's; only training the readers (once per machine) needs torch. A judge or a
    collector that starts (every restart, every drill) does not pay torch's 3-5 s of CPU and its
    memory."""
    reader(), wish_reader()  # trained here, or already in the machine's cache
    code = ("import sys, flywheel.judge.loop, flywheel.collect.loop\n"
            "from flywheel.judge.reaction_reader import reader\n"
            "from flywheel.judge.wishes import wish_reader\n"
            "print(reader().read('shorter please').label, wish_reader().read('shorter please').label)\n"
            "print(sorted(name for name in sys.modules if name.partition('.')[0] == 'torch')[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    read, imported = done.stdout.splitlines()
    assert read == f"{reader().read('shorter please').label} {wish_reader().read('shorter please').label}"
    assert imported == "[]"


def test_a_damaged_reader_is_trained_again_once_though_two_judges_found_it_so(tmp_path, monkeypatch, caplog):
    """Two judges start and find the machine's reader damaged (a truncated file). The first trains
    it again; the second, slower to act on what it read, must find the new one and use it, not
    delete it and train it a third time (nor pull it from under the first); the rebuilding is said
    once, by the one that rebuilds."""
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path))
    trainings, load, slower_read_it = [], HashedLinear.load, threading.Event()

    def train() -> HashedLinear:
        trainings.append(1)
        return HashedLinear.train(("short", "long"), [text_features("too long"), text_features("more please")],
                                  ["short", "long"], steps=5)

    def readable(path: Path) -> bool:
        with contextlib.suppress(Exception):
            return bool(load(path))
        return False

    def slow_load(path: Path) -> HashedLinear:
        try:
            return load(path)
        except Exception:
            if threading.current_thread() is not threading.main_thread() and not slower_read_it.is_set():
                slower_read_it.set()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not readable(path):  # until the first has trained it
                    time.sleep(0.01)
            raise
    first = trained_once("test", [{"said": "too long"}], [], train)
    [file] = tmp_path.glob(f"readers/test-*/{FILE}")
    file.write_bytes(file.read_bytes()[:100])
    monkeypatch.setattr(HashedLinear, "load", staticmethod(slow_load))
    with ThreadPoolExecutor(1) as pool:
        slower = pool.submit(trained_once, "test", [{"said": "too long"}], [], train)
        assert slower_read_it.wait(timeout=30)
        again = trained_once("test", [{"said": "too long"}], [], train)
        late = slower.result(timeout=60)
    assert len(trainings) == 2  # the first time, and once again
    assert [r.levelname for r in caplog.records if "building it again" in r.getMessage()] == ["WARNING"]
    assert again.probabilities(["w:too"]) == late.probabilities(["w:too"]) == first.probabilities(["w:too"])


def test_the_training_set_is_well_formed():
    examples = training_set()
    assert len(examples) >= 1500 and len({e["id"] for e in examples}) == len(examples)
    for e in examples:
        said = e["next"][0]["content"]
        assert e["gold"] in READ_LABELS and e["next"][0]["role"] == "user" and said.strip(), e["id"]
        assert (e["hint"] is not None and e["hint"] in said) if e["gold"] == "correction" else e["hint"] is None, e["id"]


def test_the_held_out_set_is_there_and_well_formed():
    """bench/data/reactions_heldout.jsonl: read by the bench only (its items are never printed)."""
    heldout = Path(__file__).resolve().parent.parent / "bench" / "data" / "reactions_heldout.jsonl"
    examples = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    assert {e["gold"] for e in examples} == set(READ_LABELS)
    assert len(unseen(examples, training_set())) >= 300  # what the bench measures: messages the reader never saw
