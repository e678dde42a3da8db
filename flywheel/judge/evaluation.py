"""Evaluating the `next_state` judge against its hand-labelled set
(`flywheel/judge/data/next_state_labelled.jsonl`): the class the judge gives each example, next to
a naive keyword baseline's, and precision and recall per class and per polarity, per split.

Each example is the turn's request, the assistant's reply, what followed it (user or tool
messages), optional feedback text about the turn, the gold class (one of
`flywheel.judge.next_state_classes.LABELS`) and its `split` (`dev`, `heldout`, `fresh`: how far it
may be trusted, docs/judges.md). It becomes a one-turn `Trajectory` (the next state in
`next_states[0]`, the feedback text as a `SessionEvent` naming the turn's interaction id), scored
by `NextStateJudge`; its class is `details["turns"][0]["class"]`. The baseline reads the same text
for keywords, first match wins (`KEYWORDS`), else `clean_tool_result` for a tool result and
`unclear` for words. `bench/judge_next_state.py` prints and keeps the tables. (The learned reader
against the rules on words their author did not write: `bench/judge_reactions.py`.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from flywheel.bus import SessionEvent, Trajectory, Turn
from flywheel.config.judge import NextStateJudgeConfig
from flywheel.judge.base import Unscorable
from flywheel.judge.next_state import NextStateJudge
from flywheel.judge.next_state_classes import LABELS, polarity

DATA = Path(__file__).resolve().parent / "data" / "next_state_labelled.jsonl"
SPLITS = ("dev", "heldout", "fresh")
KEYWORDS = [
    ("tests_failing", r"fail\w*"), ("error", r"error\w*|traceback|exception"), ("correction", r"no|wrong|not|instead"),
    ("complaint", r"broken|useless|bad|worse"), ("retry", r"again"), ("thanks", r"thanks|thank|thx"),
    ("tests_passing", r"passed|passing"), ("acceptance", r"great|ok|okay|perfect|good|works"),
    ("moving_on", r"now|next|also"),
]


def load_examples(path: Path = DATA) -> list[dict]:
    """The labelled examples, in file order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def unseen(examples: list[dict], seen: list[dict]) -> list[dict]:
    """The examples whose user message is not, word for word (case aside), one of `seen`'s (an
    evaluation set's messages its classifier was trained on: two writers may both write
    "Appreciate it!")."""
    known = {e["next"][0]["content"].strip().lower() for e in seen}
    return [e for e in examples if e["next"][0]["content"].strip().lower() not in known]


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


async def judge_labels(examples: list[dict], config: NextStateJudgeConfig | None = None) -> list[str]:
    """The judge's class of each example's turn (`unclear` where it read nothing it could score)."""
    judge = NextStateJudge(config)
    return [await _label(judge, e) for e in examples]


async def _label(judge: NextStateJudge, example: dict) -> str:
    try:
        return (await judge.score(trajectory_of(example))).details["turns"][0]["class"]
    except Unscorable:  # an example always has something after its turn: what followed was unreadable
        return "unclear"


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


async def evaluate(examples: list[dict] | None = None, config: NextStateJudgeConfig | None = None) -> dict:
    """Per split (dev, heldout, fresh, all): the judge's (with `config`) and the baseline's
    metrics, and the predictions."""
    examples = examples if examples is not None else load_examples()
    judged = dict(zip((e["id"] for e in examples), await judge_labels(examples, config)))
    out = {}
    for split in (*SPLITS, "all"):
        chosen = [e for e in examples if split == "all" or e["split"] == split]
        gold = [e["gold"] for e in chosen]
        out[split] = {"judge": metrics(gold, [judged[e["id"]] for e in chosen]),
                      "keyword": metrics(gold, [keyword_label(e) for e in chosen])}
    out["predictions"] = judged
    return out
