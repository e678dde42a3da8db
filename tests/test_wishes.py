"""What a correction asks to change, told to the teacher as an instruction (flywheel/judge/wishes.py,
`judge.teacher.wishes`): corrections in words no list holds are read as their aspect, the teacher
is told each instruction once beside or instead of the words, corrections about anything else
stay words, and the judge loop tells its teacher so. How well it reads on words its author never
saw: bench/judge_wishes.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.bus import SessionEvent, Trajectory
from flywheel.config import load_config
from flywheel.judge import hashed_classifier
from flywheel.judge.base import Verdict
from flywheel.judge.hashed_classifier import text_features, trained_once
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.reaction_reader import load
from flywheel.judge.teacher import Teaching
from flywheel.judge.wishes import ASPECTS, Wish, WishReader, most_asked, training_set, wish_reader

from factories import make_turn

SHORT = ASPECTS["shorter"]


@pytest.mark.parametrize("said, aspect", [
    ("honestly I can't read all that on my phone", "shorter"),
    ("could you break it into points I can tick off?", "list"),
    ("you never say my name... it's Maya btw", "name"),
    ("bit too chummy for something my manager will read", "formal"),
    ("je ne comprends pas l'anglais, en français svp", "language"),
])
def test_a_correction_in_words_no_list_holds_is_read_as_its_aspect(said, aspect):
    assert wish_reader().read(said).label == aspect and wish_reader().aspects([said]) == [aspect]


def test_the_teacher_is_told_what_the_corrections_ask_beside_or_instead_of_the_words():
    corrections = ["way too long for my phone", "shorter!! I said shorter"]
    assert Wish(corrections, "words").told == " ".join(corrections)
    assert Wish(corrections, "beside").told == " ".join([SHORT, *corrections])
    assert Wish(corrections, "instead").told == SHORT  # once, however many asked


def test_a_wish_reads_each_correction_once_for_teacher_and_practice(monkeypatch):
    """The teacher's instruction and practice's checked aspects come of one reading (the reader
    read each correction once for the teacher and twice more for practice); words are not read."""
    reads = []
    read = WishReader.read
    monkeypatch.setattr(WishReader, "read", lambda self, said: reads.append(said) or read(self, said))
    corrections = ["way too long for my phone", "shorter!! I said shorter"]
    wish = Wish(corrections, "instead")
    assert (wish.told, wish.aspects, wish.told) == (SHORT, ["shorter"], SHORT) and reads == corrections
    assert Wish(corrections, "words").told == " ".join(corrections) and reads == corrections


def test_a_correction_about_anything_else_and_a_bare_complaint_stay_words():
    for said in ("Canberra is the capital, not Sydney.", "bad answer"):
        assert Wish([said], "instead").told == said


def test_a_persons_corrections_are_read_together():
    """A vague correction alone is below the bar; with the person's clearer ones, what most of
    them ask for is told."""
    vague = "my thumb hurts from scrolling"
    assert Wish([vague], "instead").told == vague
    assert Wish([vague, "way too long for my phone"], "instead").told == SHORT
    listed = ["could you break it into points I can tick off?", "bullets please, I skim", "way too long for my phone"]
    assert Wish(listed, "instead").told == ASPECTS["list"]  # what most of them ask for


def test_a_preamble_read_beside_a_shorter_reply_counts_for_the_shorter_reply():
    """One short sentence has no preamble: where a person's corrections read both, the reader's
    usual mistake (a `shorter` correction read as `no_preamble`) no longer outvotes the wish."""
    assert most_asked(["no_preamble", "no_preamble", "shorter"]) == ["shorter"]
    assert most_asked(["no_preamble", "list", "list"]) == ["list"]
    assert most_asked(["no_preamble", "no_preamble", "list"]) == ["no_preamble"]  # nothing implies it
    assert most_asked(["no_preamble", "shorter", "list", "list"]) == ["shorter", "list"]


def test_every_process_trains_the_same_reader():
    """Judges on several machines must read alike: training is deterministic (a fifth of the set:
    the same code path in a second)."""
    some = training_set()[::5]
    first, again = WishReader(some), WishReader(some)
    for said in ("too long", "use my name", "que?"):
        assert again.read(said) == first.read(said)


def test_a_reader_is_trained_once_per_machine_and_read_back_exactly(tmp_path, monkeypatch):
    """A judge that starts again loads its reader from the model cache instead of training it, and
    reads exactly as the one trained; other examples (or code) train afresh."""
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path))
    some, trained = training_set()[::5], []

    def train():
        trained.append(1)
        return WishReader(some).model

    first = trained_once("wishes", some, [hashed_classifier.__file__], train)
    again = trained_once("wishes", some, [hashed_classifier.__file__], train)
    fresh = WishReader(some).model
    assert len(trained) == 1 and again.labels == fresh.labels
    for said in ("too long", "use my name", "que?"):
        assert first.probabilities(text_features(said)) == again.probabilities(text_features(said)) \
            == fresh.probabilities(text_features(said))
    trained_once("wishes", some[1:], [hashed_classifier.__file__], train)
    assert len(trained) == 2


def test_the_training_set_is_well_formed():
    examples = training_set()
    assert len(examples) >= 3000 and len({e["id"] for e in examples}) == len(examples)
    assert {e["aspect"] for e in examples} == set(ASPECTS)
    assert all(e["text"].strip() for e in examples)
    assert len({e["text"] for e in examples}) == len({(e["text"], e["aspect"]) for e in examples})  # no text has two aspects


def test_the_held_out_set_is_there_and_well_formed():
    """bench/data/correction_aspects_heldout.jsonl: read by the bench only (its items are never printed)."""
    heldout = load(Path(__file__).resolve().parent.parent / "bench" / "data" / "correction_aspects_heldout.jsonl")
    known = {e["text"].strip().lower() for e in training_set()}
    assert {e["aspect"] for e in heldout} == set(ASPECTS)
    assert len([e for e in heldout if e["text"].strip().lower() not in known]) >= 300


class Recorder:
    """A teacher that keeps what it was told."""

    def __init__(self):
        self.told: list[dict[int, str]] = []

    async def teach(self, trajectory: Trajectory, hints: dict[int, str]) -> Teaching:
        self.told.append(hints)
        return Teaching()


@pytest.mark.parametrize("mode", ["words", "instead"])
async def test_the_judge_loop_tells_its_teacher_the_instruction(mode, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "judge.kind=next_state", "judge.teacher.enabled=true",
                                f"judge.teacher.wishes={mode}"])
    loop = JudgeLoop(config, "nats://unused")
    loop.teacher = Recorder()
    turn = make_turn(id="t0", turn_index=0)
    said = "way too long for my phone"
    trajectory = Trajectory(id="s", session_id="s", segments=[], turns=[turn], next_states=[[]], close_reason="done", consent=True,
                            feedback=[SessionEvent(id="f", session_id="s", kind="feedback", text=said, interaction_id="t0")])
    _, wishes = await loop._teach(trajectory, Verdict(-1.0, [-1.0]))
    assert loop.teacher.told == [{0: said if mode == "words" else SHORT}] and wishes[0].corrections == [said]
