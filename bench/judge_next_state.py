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
    is `details["turns"][0]["class"]`.

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
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table, write_result  # noqa: E402
from flywheel.bus import SessionEvent, Trajectory, Turn  # noqa: E402
from flywheel.judge.next_state import NextStateJudge  # noqa: E402
from flywheel.judge.next_state_classes import LABELS, polarity  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "judge" / "data" / "next_state_labelled.jsonl"
SPLITS = ("dev", "heldout", "fresh")
KEYWORDS = [
    ("tests_failing", r"fail\w*"), ("error", r"error\w*|traceback|exception"), ("correction", r"no|wrong|not|instead"),
    ("complaint", r"broken|useless|bad|worse"), ("retry", r"again"), ("thanks", r"thanks|thank|thx"),
    ("tests_passing", r"passed|passing"), ("acceptance", r"great|ok|okay|perfect|good|works"),
    ("moving_on", r"now|next|also"),
]


def load_examples(path: Path = DATA) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trajectory_of(example: dict) -> Trajectory:
    """A one-turn trajectory: the request, the reply, what followed, and the feedback about the turn."""
    turn = Turn(id=f"{example['id']}-0", session_id=example["id"], turn_index=0, model="m",
                messages=[{"role": "user", "content": example["request"]}],
                response={"role": "assistant", "content": example["reply"]},
                prompt_ids=[], output_ids=[], output_logprobs=[], output_versions=[], finish_reason="stop")
    feedback = [SessionEvent(id=f"{example['id']}-f", session_id=example["id"], kind="feedback", text=example["feedback"],
                             interaction_id=turn.id)] if example.get("feedback") else []
    return Trajectory(id=example["id"], session_id=example["id"], segments=[], turns=[turn], next_states=[example["next"]],
                      feedback=feedback, close_reason="done")


async def judge_labels(examples: list[dict]) -> list[str]:
    judge = NextStateJudge()
    return [(await judge.score(trajectory_of(e))).details["turns"][0]["class"] for e in examples]


def keyword_label(example: dict) -> str:
    text = " ".join([example.get("feedback") or "", *(m["content"] for m in example["next"])]).lower()
    words = set(re.findall(r"[a-z']+", text))
    for label, pattern in KEYWORDS:
        if any(re.fullmatch(pattern, w) for w in words):
            return label
    return "clean_tool_result" if any(m["role"] == "tool" for m in example["next"]) else "unclear"


def _pr(gold: list, predicted: list, value) -> dict:
    hits = sum(g == p == value for g, p in zip(gold, predicted))
    said, real = predicted.count(value), gold.count(value)
    return {"support": real, "precision": hits / said if said else None, "recall": hits / real if real else None}


def metrics(gold: list[str], predicted: list[str]) -> dict:
    gold_pol, pred_pol = [polarity(g) for g in gold], [polarity(p) for p in predicted]
    return {
        "n": len(gold),
        "class_accuracy": sum(g == p for g, p in zip(gold, predicted)) / len(gold),
        "polarity_accuracy": sum(g == p for g, p in zip(gold_pol, pred_pol)) / len(gold),
        "classes": {label: _pr(gold, predicted, label) for label in LABELS},
        "polarity": {str(v): _pr(gold_pol, pred_pol, v) for v in (1, -1, 0)},
    }


async def evaluate(examples: list[dict] | None = None) -> dict:
    """Per split (dev, heldout, all): the judge's and the baseline's metrics, and the predictions."""
    examples = examples if examples is not None else load_examples()
    judged = dict(zip((e["id"] for e in examples), await judge_labels(examples)))
    out = {}
    for split in (*SPLITS, "all"):
        chosen = [e for e in examples if split == "all" or e["split"] == split]
        gold = [e["gold"] for e in chosen]
        out[split] = {"judge": metrics(gold, [judged[e["id"]] for e in chosen]),
                      "keyword": metrics(gold, [keyword_label(e) for e in chosen])}
    out["predictions"] = judged
    return out


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
    args = parser.parse_args()
    examples = load_examples()
    result = asyncio.run(evaluate(examples))
    print(report(result))
    if args.errors:
        for e in examples:
            if e["split"] == "dev" and result["predictions"][e["id"]] != e["gold"]:
                print(f"{e['id']} gold={e['gold']} judge={result['predictions'][e['id']]}: "
                      f"{json.dumps(e.get('feedback') or e['next'][-1]['content'])[:160]}")
    summary = {split: result[split] for split in (*SPLITS, "all")}
    print(f"wrote {write_result('judge_next_state', {'data': str(DATA.relative_to(DATA.parents[2])), **summary})}")


if __name__ == "__main__":
    main()
