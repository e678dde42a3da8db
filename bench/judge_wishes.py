"""How well the judge reads what a correction asks to change (flywheel/judge/wishes.py), on words
its author did not write, and which instructions it would tell the teacher.

Sets
    - `heldout`: bench/data/correction_aspects_heldout.jsonl, written by a helper from a brief
      (/work/notes/aspect_brief.md, quoted in docs/experiments/learning-from-use.md) without
      opening any file of the project; the reader's author never read it (this bench prints no
      item). Texts the training set also holds word for word are left out;
    - `train (5-fold)`: the reader's own training set (another helper, the same brief), each fifth
      read by a reader trained on the other four;
    - `reactions`: the corrections and complaints of the reaction sets (bench/data/reactions_heldout.jsonl,
      and the reaction reader's training corrections) have no aspect labels: only how often an
      instruction would be told, and which, is counted there (a complaint says a reply is wrong,
      not how to change its form: an instruction told for one is a mistake; the training set's
      complaints are the reader's `other` examples).

Numbers
    - per aspect precision and recall, and accuracy;
    - **told**: of the corrections, the share whose aspect is read at `WISH_AT` or more and is one
      with an instruction (what the teacher is told), and of those the share that is right
      (**told right**): a wrong instruction teaches the wrong thing, a missing one only keeps the
      person's words;
    - the same for the probability bars `--bars` (how `WISH_AT` was chosen, on the 5-fold set);
    - with `--people`: for each person of a people file, by labels alone, what the teacher is
      told of the probe's draw of their corrections and of all of them, and how often the gateway
      serves their wish (alone, or among others) over `--windows` orders of their corrections;
      the same on the held-out set, each aspect's corrections taken as one person's.

    .venv/bin/python bench/judge_wishes.py                # bench/results/judge_wishes.json
    .venv/bin/python bench/judge_wishes.py --no-heldout   # while changing the reader
    .venv/bin/python bench/judge_wishes.py --people bench/data/people_heldout.json bench/data/people_heldout_2.json
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from statistics import fmean
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, table, write_result  # noqa: E402
from flywheel.config.memory import MemoryConfig  # noqa: E402
from flywheel.judge import reaction_reader  # noqa: E402
from flywheel.judge.hashed_classifier import Reading  # noqa: E402
from flywheel.judge.instruction_memory import wanted  # noqa: E402
from flywheel.judge.wishes import ASPECTS, LABELS, UNSERVED, WISH_AT, WishReader, training_set, wish_reader  # noqa: E402

HELDOUT = ROOT / "bench" / "data" / "correction_aspects_heldout.jsonl"
REACTIONS_HELDOUT = ROOT / "bench" / "data" / "reactions_heldout.jsonl"


def cross_validated(examples: list[dict], folds: int = 5) -> list[Reading]:
    """Each fold read by a reader trained on the others (seeded folds)."""
    order = list(range(len(examples)))
    random.Random(0).shuffle(order)
    out: list[Reading | None] = [None] * len(examples)
    for k in range(folds):
        held = set(order[k::folds])
        model = WishReader([e for i, e in enumerate(examples) if i not in held])
        for i in held:
            out[i] = model.read(examples[i]["text"])
    return out  # type: ignore[return-value]


def is_told(readings: list[Reading], bar: float) -> list[bool]:
    """Whether each reading gets an instruction at probability `bar`."""
    return [r.probability >= bar and ASPECTS[r.label] is not None for r in readings]


def scores(examples: list[dict], readings: list[Reading], bars: list[float]) -> dict:
    gold, said = [e["aspect"] for e in examples], [r.label for r in readings]
    classes = {}
    for label in LABELS:
        hits = sum(g == s == label for g, s in zip(gold, said))
        classes[label] = {"n": gold.count(label), "precision": hits / said.count(label) if said.count(label) else None,
                          "recall": hits / gold.count(label) if gold.count(label) else None}
    at = {}
    for bar in sorted({*bars, WISH_AT}):
        telling = is_told(readings, bar)
        right = [g == s for g, s, t in zip(gold, said, telling) if t]
        formed = [t for g, t in zip(gold, telling) if ASPECTS[g] is not None]
        at[f"{bar:.2f}"] = {"told": sum(telling) / len(telling), "told_right": sum(right) / len(right) if right else None,
                            "form_told": sum(formed) / len(formed) if formed else None,
                            "other_told": (sum(t for g, t in zip(gold, telling) if ASPECTS[g] is None)
                                           / max(1, gold.count("other")))}
    return {"n": len(examples), "accuracy": sum(g == s for g, s in zip(gold, said)) / len(gold), "classes": classes,
            "at": at}


def reactions(gold: str, heldout: bool) -> list[str]:
    """The messages of class `gold` in the reaction reader's held-out set or its training set."""
    examples = reaction_reader.load(REACTIONS_HELDOUT) if heldout else reaction_reader.training_set()
    return [e["next"][0]["content"] for e in examples if e["gold"] == gold]


WANTED = {"brief": "shorter", "bullets": "list", "name": "name", "formal": "formal"}
"""The aspect each preference of a people file is about."""


def people(path: str, draw: int, windows: int) -> dict:
    """Per person of a people file (bench/data/people_heldout*.json), by aspect labels only (their
    words stay unread): the share of their corrections read alone as their wish, and what the
    teacher is told of `draw` of them at once (the same draw as `personal_agent.py --probe-hints
    --probe-together`) and of all of them; what the gateway serves them (`served_windows`)."""
    from flywheel.drills.simulated_people import User, people_from

    out = {}
    for key, (name, preference, voice) in sorted(people_from(path).items()):
        wish = WANTED[preference.kind]
        drawn = User(name, preference, seed=int(key.split("-")[1]) - 1, voice=voice).rng.sample(
            voice.corrections, min(draw, len(voice.corrections)))
        out[key] = {"alone_right": sum(wish_reader().aspect(c) == wish for c in voice.corrections)
                    / len(voice.corrections),
                    "drawn": wish_reader().aspects(drawn),
                    "all": wish_reader().aspects(voice.corrections),
                    "served": served_windows(voice.corrections, wish, windows)}
    return out


def served_windows(corrections: list[str], wish: str, windows: int, size: int = MemoryConfig().corrections) -> dict:
    """What the served memory serves a person whose corrections come in a random order: over
    `windows` seeded orders, the aspects of their newest `size` that read one (`memory.corrections`)
    as the judge votes them (`instruction_memory.wanted`); the share served their wish alone, and
    with others."""
    read = [wish_reader().aspect(c) for c in corrections]
    served = []
    for seed in range(windows):
        order = random.Random(seed).sample(read, len(read))
        served.append(wanted([aspect for aspect in order if aspect][:size]))
    return {"alone": sum(s == [wish] for s in served) / windows, "with": sum(wish in s for s in served) / windows}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def report(result: dict) -> str:
    parts = []
    for name, s in result["sets"].items():
        parts.append(f"## {name} ({s['n']} corrections), accuracy {_pct(s['accuracy'])}\n")
        parts.append(table(["aspect", "n", "precision", "recall"],
                           [[label, c["n"], _pct(c["precision"]), _pct(c["recall"])] for label, c in s["classes"].items()]))
        parts.append("\n" + table(["bar", "told", "told right", "form wishes told", "`other` told"],
                                  [[bar, _pct(a["told"]), _pct(a["told_right"]), _pct(a["form_told"]), _pct(a["other_told"])]
                                   for bar, a in s["at"].items()]) + "\n")
        if "served" in s:
            parts.append("served, each aspect's corrections as one person's: its aspect alone / with others\n\n" + table(
                ["aspect", "alone", "with others"],
                [[aspect, _pct(w["alone"]), _pct(w["with"])] for aspect, w in s["served"].items()]) + "\n")
    for file, by_person in result.get("people", {}).items():
        parts.append(f"\n## {file}: what the teacher is told (aspects; their wish alone: "
                     f"{sum(p['drawn'] == [WANTED[k.split('-')[0]]] for k, p in by_person.items())} of {len(by_person)} "
                     f"drawn, {sum(p['all'] == [WANTED[k.split('-')[0]]] for k, p in by_person.items())} of {len(by_person)} all)\n")
        parts.append(table(["person", "corrections read alone as the wish", "told of the probe's draw", "told of all",
                            "served the wish alone / with others"],
                           [[k, _pct(p["alone_right"]), " ".join(p["drawn"]) or "(words)", " ".join(p["all"]) or "(words)",
                             f"{_pct(p['served']['alone'])} / {_pct(p['served']['with'])}"] for k, p in by_person.items()]))
        parts.append(f"\nserved the wish alone, mean: {fmean(p['served']['alone'] for p in by_person.values()):.2f}; "
                     f"with others: {fmean(p['served']['with'] for p in by_person.values()):.2f}\n")
    for name, r in result["reactions"].items():
        parts.append(f"## {name} ({r['n']}): an instruction told for {_pct(r['told'])}; "
                     + ", ".join(f"{k} {v}" for k, v in r["aspects"].items()))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="judge_wishes")
    parser.add_argument("--no-heldout", action="store_true", help="leave the held-out set unread (while the reader changes)")
    parser.add_argument("--bars", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7])
    parser.add_argument("--people", nargs="*", default=[], help="people files: what the teacher is told of each person")
    parser.add_argument("--draw", type=int, default=5, help="with --people: corrections told at once (the probe's)")
    parser.add_argument("--windows", type=int, default=500, help="with --people: orders of their corrections served")
    args = parser.parse_args()
    train = training_set()
    sets = {}
    if not args.no_heldout:
        known = {e["text"].strip().lower() for e in train}
        heldout = [e for e in reaction_reader.load(HELDOUT) if e["text"].strip().lower() not in known]
        sets["heldout"] = scores(heldout, [wish_reader().read(e["text"]) for e in heldout], args.bars)
        sets["heldout"]["served"] = {aspect: served_windows([e["text"] for e in heldout if e["aspect"] == aspect], aspect,
                                                            args.windows)
                                     for aspect in LABELS if ASPECTS[aspect] and aspect not in UNSERVED}
    sets["train (5-fold)"] = scores(train, cross_validated(train), args.bars)
    result = {"sets": sets, "reactions": {}, "people": {file: people(file, args.draw, args.windows) for file in args.people}}
    for gold, heldout in (("correction", True), ("complaint", True), ("correction", False)):
        if heldout and args.no_heldout:
            continue
        readings = [wish_reader().read(text) for text in reactions(gold, heldout)]
        telling = is_told(readings, WISH_AT)
        result["reactions"][f"the reaction {'held-out' if heldout else 'training'} set's {gold}s"] = {
            "n": len(readings), "told": sum(telling) / len(telling),
            "aspects": dict(Counter(r.label for r, t in zip(readings, telling) if t).most_common())}
    print(report(result))
    write_result(args.name, result)


if __name__ == "__main__":
    main()
