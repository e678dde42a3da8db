"""How well the `next_state` judge reads people's words after a reply, on words its author did not
write: the learned reader (flywheel/judge/reaction_reader.py) against the phrasing rules
(flywheel/judge/next_state_rules.py), per class, and the two numbers learning depends on.

Sets
    - `heldout`: bench/data/reactions_heldout.jsonl, written by a helper from a brief
      (/work/notes/reaction_brief.md, quoted in docs/experiments/learning-from-use.md) who read
      none of the judge's code; its author never read it (nor its mistakes: this bench prints
      none), before or after the reader was done. Messages the training set also holds word for
      word (13 short ones, "Appreciate it!") are left out;
    - `train (5-fold)`: the reader's own training set (another helper, same brief), each fifth read
      by a reader trained on the other four: how it does on its own writer's style;
    - `old`: flywheel/judge/data/next_state_labelled.jsonl's examples of user words, written by the
      rules' author (the rules were tuned on its `dev` split).

Numbers
    - per class (`correction complaint retry acceptance thanks moving_on unclear`) precision and
      recall, and polarity accuracy (+1 approval and moving on, -1 correction, complaint and retry);
    - **corrections read with a hint**: of the gold corrections, the share the judge gives a hint
      (what the teacher needs), and the share read as a correction exactly;
    - **new requests read as hints**: of the gold `moving_on`, the share the judge gives a hint.
    Aims (issue 45): at least 90 % and at most 10 %.

    .venv/bin/python bench/judge_reactions.py      # bench/results/judge_reactions.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, table, write_result  # noqa: E402
from flywheel.config.judge import NextStateJudgeConfig  # noqa: E402
from flywheel.judge.evaluation import DATA as OLD  # noqa: E402
from flywheel.judge.evaluation import unseen  # noqa: E402
from flywheel.judge.next_state import classify_next_state, hint_of  # noqa: E402
from flywheel.judge.next_state_classes import polarity  # noqa: E402
from flywheel.judge.reaction_reader import (  # noqa: E402
    READ_LABELS,
    ReactionReader,
    load,
    training_set,
)

HELDOUT = ROOT / "bench" / "data" / "reactions_heldout.jsonl"


def user_words(examples: list[dict]) -> list[dict]:
    """The examples whose next state is user words about the turn and whose class the reader knows."""
    return [e for e in examples if e["gold"] in READ_LABELS and not e.get("feedback")
            and any(m["role"] == "user" for m in e["next"]) and not any(m["role"] != "user" for m in e["next"])]


def judge_reads(examples: list[dict], reader: str) -> list[tuple[str, bool]]:
    """(class, whether a hint was read) for each example, as the judge reads it with `reader`."""
    config = NextStateJudgeConfig(reader=reader)
    out = []
    for e in examples:
        call, words = classify_next_state(e["next"], e["request"], e["reply"], config)
        out.append((call.label, bool(words and hint_of(call, words, config))))
    return out


def cross_validated(examples: list[dict], folds: int = 5) -> list[tuple[str, bool]]:
    """Each fold read by a reader trained on the others (seeded folds)."""
    order = list(range(len(examples)))
    random.Random(0).shuffle(order)
    out: list[tuple[str, bool] | None] = [None] * len(examples)
    for k in range(folds):
        held = set(order[k::folds])
        model = ReactionReader([e for i, e in enumerate(examples) if i not in held])
        for i in held:
            e = examples[i]
            label = model.read(e["next"][0]["content"], e["request"], e["reply"]).label
            out[i] = (label, label in ("correction", "complaint"))
    return out  # type: ignore[return-value]


def scores(examples: list[dict], reads: list[tuple[str, bool]]) -> dict:
    gold, said = [e["gold"] for e in examples], [label for label, _ in reads]
    classes = {}
    for label in READ_LABELS:
        hits = sum(g == s == label for g, s in zip(gold, said))
        classes[label] = {"n": gold.count(label), "precision": hits / said.count(label) if said.count(label) else None,
                          "recall": hits / gold.count(label) if gold.count(label) else None}
    corrections = [r for e, r in zip(examples, reads) if e["gold"] == "correction"]
    new = [r for e, r in zip(examples, reads) if e["gold"] == "moving_on"]
    sign = [polarity(x) for x in gold], [polarity(x) for x in said]
    return {"n": len(examples), "classes": classes,
            "accuracy": sum(g == s for g, s in zip(gold, said)) / len(gold),
            "polarity_accuracy": sum(a == b for a, b in zip(*sign)) / len(gold),
            "corrections_hinted": sum(h for _, h in corrections) / len(corrections) if corrections else None,
            "corrections_exact": sum(label == "correction" for label, _ in corrections) / len(corrections) if corrections else None,
            "new_requests_hinted": sum(h for _, h in new) / len(new) if new else None}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def report(result: dict) -> str:
    parts = []
    for name, by_reader in result["sets"].items():
        readers = list(by_reader)
        first = by_reader[readers[0]]
        parts.append(f"## {name} ({first['n']} messages)\n")
        rows = [[what, *(_pct(by_reader[r][key]) for r in readers)] for what, key in (
            ("corrections read with a hint (aim >= 90 %)", "corrections_hinted"),
            ("corrections read as corrections", "corrections_exact"),
            ("new requests read as hints (aim <= 10 %)", "new_requests_hinted"),
            ("class accuracy", "accuracy"), ("polarity accuracy", "polarity_accuracy"))]
        parts.append(table(["", *readers], rows))
        rows = [[label, first["classes"][label]["n"], *(_pct(by_reader[r]["classes"][label][q]) for r in readers
                                                      for q in ("precision", "recall"))] for label in READ_LABELS]
        parts.append("\n" + table(["class", "n", *(f"{r} {q}" for r in readers for q in ("P", "R"))], rows) + "\n")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="judge_reactions")
    parser.add_argument("--no-heldout", action="store_true", help="leave the held-out set unread (while the reader changes)")
    args = parser.parse_args()
    sets = {}
    train = user_words(training_set())
    if not args.no_heldout:
        heldout = unseen(user_words(load(HELDOUT)), train)
        sets["heldout"] = {r: scores(heldout, judge_reads(heldout, r)) for r in ("learned", "rules")}
    sets["train (5-fold)"] = {"learned": scores(train, cross_validated(train)), "rules": scores(train, judge_reads(train, "rules"))}
    old = user_words([json.loads(line) for line in OLD.read_text().splitlines() if line.strip()])
    sets["old"] = {r: scores(old, judge_reads(old, r)) for r in ("learned", "rules")}
    result = {"sets": sets}
    print(report(result))
    write_result(args.name, result)


if __name__ == "__main__":
    main()
