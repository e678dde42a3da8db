"""How well the `next_state` judge classifies what followed a reply: precision and recall per class
and per polarity on the hand-labelled set, against a naive keyword baseline.

What it measures
    flywheel/judge/data/next_state_labelled.jsonl: hand-written examples, each the turn's request, the
    assistant's reply, what followed it (user or tool messages), optional feedback text about
    the turn, the gold class (one of `flywheel.judge.next_state_classes.LABELS`) and polarity (+1/-1/0).
    `split` says how each may be trusted. `dev` (130) and `heldout` (56, a fixed 30 % drawn by a
    seeded shuffle) were written before the classifier; the rules were developed on `dev`'s
    numbers and mistakes only, but by the author of all of them, so `heldout` is optimistic.
    `fresh` (49) was written after the rules were frozen and never used to change them: the
    most honest estimate of the three. Each example becomes a
    one-turn `Trajectory` (the next state in `next_states[0]`, the feedback text as a
    `SessionEvent` naming the turn's interaction id) and is scored by `NextStateJudge`; its class
    is `details["turns"][0]["class"]` (`flywheel/judge/evaluation.py`).

    The baseline reads the same text (feedback and next state) for keywords, first match wins:
    tests_failing (fail...), error (error, traceback, exception), correction (no, wrong, not,
    instead), complaint (broken, useless, bad, worse), retry (again), thanks (thanks, thank, thx),
    tests_passing (passed, passing), acceptance (great, ok, okay, perfect, good, works),
    moving_on (now, next, also), else clean_tool_result for a tool result and unclear for words.

How to run (from the repository root)
    .venv/bin/python bench/judge_next_state.py            # the tables; bench/results/judge_next_state.json
    .venv/bin/python bench/judge_next_state.py --errors   # also the dev split's misclassified examples
    The other splits' mistakes are never printed: they stay unseen while the rules change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, table, write_result  # noqa: E402
from flywheel.config.judge import NextStateJudgeConfig  # noqa: E402
from flywheel.judge.evaluation import DATA, SPLITS, evaluate, load_examples  # noqa: E402
from flywheel.judge.next_state_classes import LABELS  # noqa: E402


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def report(result: dict) -> str:
    parts = []
    for split in SPLITS:
        judge, keyword = result[split]["judge"], result[split]["keyword"]
        parts.append(f"## {split} ({judge['n']} examples)\n")
        parts.append(table(["", "judge", "keyword baseline"], [
            ["class accuracy", _pct(judge["class_accuracy"]), _pct(keyword["class_accuracy"])],
            ["polarity accuracy", _pct(judge["polarity_accuracy"]), _pct(keyword["polarity_accuracy"])]]))
        for kind, header, names in (("polarity", "polarity", ["1", "-1", "0"]), ("classes", "class", LABELS)):
            rows = [[name, judge[kind][name]["support"], *(_pct(m[kind][name][q]) for m in (judge, keyword)
                                                           for q in ("precision", "recall"))] for name in names]
            parts.append("\n" + table([header, "n", "judge P", "judge R", "keyword P", "keyword R"], rows))
        parts.append("")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--errors", action="store_true", help="list the dev split's misclassified examples")
    parser.add_argument("--reader", choices=("rules", "learned"), default="rules",
                        help="what reads user words (judge.next_state.reader); the tables docs/judges.md keeps are the rules'")
    args = parser.parse_args()
    examples = load_examples()
    result = asyncio.run(evaluate(examples, NextStateJudgeConfig(reader=args.reader)))
    print(report(result))
    if args.errors:
        for e in examples:
            if e["split"] == "dev" and result["predictions"][e["id"]] != e["gold"]:
                print(f"{e['id']} gold={e['gold']} judge={result['predictions'][e['id']]}: "
                      f"{json.dumps(e.get('feedback') or e['next'][-1]['content'])[:160]}")
    summary = {split: result[split] for split in (*SPLITS, "all")}
    name = "judge_next_state" if args.reader == "rules" else f"judge_next_state_{args.reader}"
    print(f"wrote {write_result(name, {'data': str(DATA.relative_to(ROOT)), 'reader': args.reader, **summary})}")


if __name__ == "__main__":
    main()
