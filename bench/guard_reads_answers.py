"""Whether the adapter guard's reading of answers (flywheel/train/adapter_guard.py, `guard_answers`)
sees what a careful reader sees, on replies its author did not label.

The guard takes a reply to answer its question when the base model finds it fitting that
question better than another (log p(reply | its question) - log p(reply | the next question),
nats a token: `AdapterGuard.relevance_of`) by at least half the mean of its reference's replies.
Here that measure reads the held-out replies of personal-agent trials that blind readers
labelled (`bench/heldout_answers.py`: each reply answers or not; the key file says which trial
and which policy wrote it: `before` the base, `after` the trained adapter with what was served,
`base_served` the base with it). Per trial and policy: the reader's share, the measure's mean,
and the share at or above the guard's bar (half the mean of the trial's `before` replies, the
base's, as the guard's reference is the base); over all replies, the chance that a reply the
reader finds answering scores above one it does not (auc). The question is whether the guard
could have seen the adapter's cost the readers found (`after` under `base_served`).

    .venv/bin/python bench/guard_reads_answers.py --results NAME [NAME ...]   # bench/results/guard_reads_answers.json

Each reply is read bare (its question as the only message): the files do not hold the system
message the bench asked with. The bench prints no reply or question.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.adapter_guard import guard_for  # noqa: E402
from bench.heldout_answers import labelled  # noqa: E402
from bench.judge_answers import auc  # noqa: E402
from bench.lib.common import quiet_logs, table, write_result  # noqa: E402

HEADERS = ["trial", "policy", "replies", "reader", "mean relevance", "guard reads answering"]
LORA = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
"""A guard needs an adapter set; its base reads the replies (no adapter is used)."""


def by_trial(name: str) -> dict[tuple[str, str], list[dict]]:
    """The replies of results `name` a reader labelled, by (trial, policy), in the file's order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for item in labelled(name):
        groups.setdefault((f"{name}:{item['trial']}", item["when"]), []).append(item)
    return groups


def read(guard, items: list[dict]) -> list[float]:
    """The guard's relevance of each item's reply to its question (the next item's as the other)."""
    tokenizer = guard.tokenizer
    guard.questions = tuple(item["question"] for item in items)
    end = [tokenizer.eos_token_id]
    return guard.relevance_of([tokenizer.encode(item["reply"], add_special_tokens=False) + end for item in items])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, help="results names whose replies a reader labelled")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="guard_reads_answers")
    args = parser.parse_args()
    quiet_logs()
    _, guard = guard_for(LORA, args.model)
    groups = {key: items for name in args.results for key, items in by_trial(name).items()}
    for items in groups.values():
        for item, relevance in zip(items, read(guard, items)):
            item["relevance"] = relevance
    rows = []
    for (trial, policy), items in sorted(groups.items()):
        if (trial, "before") not in groups:
            raise SystemExit(f"{trial}: no replies of the base (`before`) to set the guard's bar by")
        bar = fmean(i["relevance"] for i in groups[(trial, "before")]) / 2
        rows.append([trial, policy, len(items), fmean(i["answers"] for i in items), fmean(i["relevance"] for i in items),
                     fmean(i["relevance"] >= bar for i in items)])
    every = [i for items in groups.values() for i in items]
    overall = {"replies": len(every), "reader_answers": fmean(i["answers"] for i in every),
               "auc": auc([i["relevance"] for i in every if i["answers"]], [i["relevance"] for i in every if not i["answers"]])}
    by_policy = {policy: [fmean(r[k] for r in rows if r[1] == policy) for k in (3, 4, 5)] for policy in {r[1] for r in rows}}
    print(table(HEADERS, rows))
    print(overall, {p: [round(v, 3) for v in vs] for p, vs in by_policy.items()})
    path = write_result(args.name, {"args": vars(args), "headers": HEADERS, "rows": rows, "overall": overall,
                                    "by_policy": {"columns": HEADERS[3:], **by_policy}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
