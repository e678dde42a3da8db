"""Of two short replies to a request, one that answers and one that does not, which would the best of
k serve a person who asked for shorter replies (`memory.best_of`, flywheel/formats/wish_checks.py)?

Set: bench/data/short_reply_groups_heldout.jsonl, written by a helper from a brief (/work/notes/
short_answer_brief.md, quoted in docs/experiments/learning-from-use.md) without opening any file of
the project; the pick's author never read it (this bench prints no item). Each item: a system
message or none, a request, its language, and four replies of at most 25 words, two that answer
and two that do not (most of those on the request's topic, in its words).

Each reply is read as the gateway reads a draw: SmolLM2-135M, the `shorter` instruction before the
request as the served memory puts it, the reply's information about the request (its log-prob
after the request less after the request emptied, the instruction kept; here in process). Then,
for every ordered pair of a group's replies and for all four, the reply served by
    - **shortest**: the checks of practice (`wish_checks.rewards`, the shortest of those read as
      answering; the pick of `memory.best_of` before this bench);
    - **best**: `wish_checks.best` (of those read as answering, the most information per character);
and the share of served replies that answer, by the helper's label (a reply served where none is
read as answering is the first). Also the reading alone: answers passed (information above zero),
non-answers caught, and within a request how often an answer has more information per character
than a non-answer, and more information in all.

    .venv/bin/python bench/judge_short_replies.py       # bench/results/judge_short_replies.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import information, served  # noqa: E402
from flywheel.bus.instructions import placed_before  # noqa: E402
from flywheel.formats.wish_checks import characters, rewards  # noqa: E402
from flywheel.judge.wishes import ASPECTS  # noqa: E402

HEADERS = ["group", "requests", "mixed pairs: shortest", "best", "all four: shortest", "best", "answers passed",
           "non-answers caught", "per character: answer above", "in all: answer above"]
SHORTER = [ASPECTS["shorter"]]


def shortest(texts: list[str], gains: list[float], messages: list[dict]) -> int:
    scores = rewards(["shorter"], texts, messages, [g > 0 for g in gains])
    return 0 if scores is None else max(range(len(texts)), key=scores.__getitem__)


def most_per_character(texts: list[str], gains: list[float], messages: list[dict]) -> int:
    return served(["shorter"], texts, gains, messages)


PICKS = {"shortest": shortest, "best": most_per_character}


def read(model, tokenizer, group: dict) -> None:
    """Each reply's information about the request, as the gateway reads a draw."""
    messages = [*([{"role": "system", "content": group["system"]}] if group.get("system") else []),
                {"role": "user", "content": placed_before(SHORTER) + group["request"]}]
    group["messages"] = messages
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = [tokenizer.encode(reply["reply"], add_special_tokens=False) + [end] for reply in group["replies"]]
    for reply, gain in zip(group["replies"], information(model, tokenizer, messages, SHORTER, replies)):
        reply["gain"] = gain
        reply["per_character"] = gain / max(1, characters(reply["reply"]))


def served_answers(groups: list[dict], pick, pairs: bool) -> float:
    served = []
    for g in groups:
        replies = g["replies"]
        for chosen in (itertools.permutations(replies, 2) if pairs else [replies]):
            if pairs and chosen[0]["answers"] == chosen[1]["answers"]:
                continue
            j = pick([r["reply"] for r in chosen], [r["gain"] for r in chosen], g["messages"])
            served.append(chosen[j]["answers"])
    return fmean(served)


def row(groups: list[dict]) -> list:
    replies = [r for g in groups for r in g["replies"]]
    yes, no = [r for r in replies if r["answers"]], [r for r in replies if not r["answers"]]
    within = [(a, n) for g in groups for a in g["replies"] if a["answers"] for n in g["replies"] if not n["answers"]]
    served = [served_answers(groups, pick, pairs) for pairs in (True, False) for pick in PICKS.values()]
    return [len(groups), *(round(share, 2) for share in served),
            round(fmean(r["gain"] > 0 for r in yes), 2), round(fmean(r["gain"] <= 0 for r in no), 2),
            round(fmean(a["per_character"] > n["per_character"] for a, n in within), 2),
            round(fmean(a["gain"] > n["gain"] for a, n in within), 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default=str(ROOT / "bench/data/short_reply_groups_heldout.jsonl"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="judge_short_replies")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.models import load_model

    model, tokenizer = load_model(args.model)
    groups = [json.loads(line) for line in Path(args.set).read_text(encoding="utf-8").splitlines() if line.strip()]
    for group in groups:
        read(model, tokenizer, group)
    parts = {"English": [g for g in groups if g["lang"] == "en"],
             "other languages": [g for g in groups if g["lang"] != "en"], "all": groups}
    rows = {name: row(part) for name, part in parts.items()}
    print(table(HEADERS, [[name, *r] for name, r in rows.items()]))
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "headers": HEADERS, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
