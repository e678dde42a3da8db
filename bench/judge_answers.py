"""How well the base model tells a reply that answers its request from one that does not
(flywheel/judge/relevance.py: the reply's pointwise information about the request, above zero),
on pairs its author did not write.

Set: bench/data/answer_pairs_heldout.jsonl, written by a helper from a brief (/work/notes/
answer_brief.md, quoted in docs/experiments/learning-from-use.md) without opening any file of
the project; the measure's author never read it (this bench prints no item). Each item: a system
message or none, a request, a reply, whether a careful reader finds that it answers, a `kind` of
the helper's own and a language.

The measure runs as practice runs it: a judge's server (`serve.role: judge`, the model's base)
scores the reply's tokens after the request and after the request emptied (`/engine/score`
twice), through the judge's own `Teacher`. Numbers, per language group and over all:
    - **answers passed**: of the replies that answer, the share read as answering (one read as not
      would rank last in its practice group: a good reply pushed down);
    - **non-answers caught**: of those that do not, the share read as not answering;
    - **auc**: the chance that an answer scores above a non-answer (threshold-free);
and, for comparison, the same two shares for the personal-agent bench's own rule of a person
(`flywheel/drills/simulated_people.answers`: a content word in common, not one word over and
over), which practice must not use (the bench measures with it).

    .venv/bin/python bench/judge_answers.py        # bench/results/judge_answers.json
    .venv/bin/python bench/judge_answers.py --replies NAME [NAME ...] --name judge_answers_trials
        # the same on trials' held-out replies blind readers labelled (bench/heldout_answers.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.heldout_answers import labelled  # noqa: E402
from bench.lib.common import ROOT, machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.served import Served  # noqa: E402

HEADERS = ["items", "answers", "passed", "non-answers", "caught", "auc", "rule passed", "rule caught"]


def messages_of(item: dict) -> list[dict]:
    return [*([{"role": "system", "content": item["system"]}] if item.get("system") else []),
            {"role": "user", "content": item["request"]}]


def auc(answers: list[float], others: list[float]) -> float | None:
    if not answers or not others:
        return None
    return sum((a > o) + 0.5 * (a == o) for a in answers for o in others) / (len(answers) * len(others))


def row(items: list[dict]) -> list:
    yes = [i for i in items if i["answers"]]
    no = [i for i in items if not i["answers"]]
    share = (lambda group, key, want: sum(i[key] == want for i in group) / len(group) if group else None)
    return [len(items), len(yes), share(yes, "read", True), len(no), share(no, "read", False),
            auc([i["gain"] for i in yes], [i["gain"] for i in no]), share(yes, "rule", True), share(no, "rule", False)]


def trials_replies(names: list[str]) -> list[dict]:
    """Trials' labelled held-out replies as items: each asked bare (the files hold no system
    message), in English, its `kind` the policy that wrote it."""
    return [{"request": i["question"], "reply": i["reply"], "answers": i["answers"], "lang": "en", "kind": i["when"]}
            for name in names for i in labelled(name)]


async def measure(items: list[dict], model: str) -> None:
    from transformers import AutoTokenizer

    from flywheel.drills.simulated_people import answers
    from flywheel.judge.relevance import information
    from flywheel.judge.teacher import Teacher
    from flywheel.models.checkpoints import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    async with Served(model, ["serve.role=judge"]) as served:
        teacher = Teacher(served.config.judge.teacher, served.url)
        for item in items:
            reply = tokenizer.encode(item["reply"], add_special_tokens=False) + [end]
            item["gain"] = await information(teacher, messages_of(item), reply)
            item["read"] = item["gain"] > 0
            item["rule"] = answers(item["request"], item["reply"])
        await teacher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default=str(ROOT / "bench/data/answer_pairs_heldout.jsonl"))
    parser.add_argument("--replies", nargs="+", help="instead of --set: personal-agent trials' held-out replies a "
                        "reader labelled (bench/heldout_answers.py), by results name; grouped by policy")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="judge_answers")
    args = parser.parse_args()
    quiet_logs()
    if args.replies:
        args.set = None  # the result names what it read
    items = trials_replies(args.replies) if args.replies else [
        json.loads(line) for line in Path(args.set).read_text(encoding="utf-8").splitlines() if line.strip()]
    asyncio.run(measure(items, args.model))
    groups = {"English": [i for i in items if i["lang"] == "en"], "other languages": [i for i in items if i["lang"] != "en"],
              "all": items}
    rows = {name: row(group) for name, group in groups.items()}
    kinds = {kind: row([i for i in items if i["kind"] == kind]) for kind in sorted({i["kind"] for i in items})}
    print(table(["group", *HEADERS], [[name, *r] for name, r in rows.items()]))
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "headers": HEADERS, "rows": rows,
                                    "by_kind": kinds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
