"""Issue 45: where in a request the served memory's instructions work best (`memory.placement`).

The served memory (flywheel/serve/served_memory.py) puts the instructions the judge read in a
person's corrections into their requests. This asks SmolLM2-135M the bench's training questions
(`--questions` of them, each once per seed of `--seeds`, the app's temperature and max_tokens) as
one person of each preference of a people file (`--people`, written by a helper) with the right
instruction for that preference (`WANTED`: what reading their corrections should give) put where
each placement puts it, exactly as the gateway does (`drills.personal_agent.Asked`), and scores
the replies by the person's own rule:

- `met`: answers the question and meets the preference (the personal-agent bench's measure of
  a first reply); `form`: meets the preference, answered or not; `answers`: answers the question
  (the bench's rule);
- placements: `none` (no instructions: the base as it is), `system` (the end of the system
  message), `user` (before the question's text).

    .venv/bin/python bench/memory_placement.py --people bench/data/people_heldout.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.judge_wishes import WANTED  # noqa: E402
from bench.lib.common import machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import sample  # noqa: E402
from flywheel.config.memory import MemoryConfig  # noqa: E402
from flywheel.drills.personal_agent import Asked  # noqa: E402
from flywheel.drills.simulated_people import TRAIN_QUESTIONS, User, answers, people_from  # noqa: E402
from flywheel.judge.wishes import ASPECTS  # noqa: E402

PLACEMENTS = ("none", "system", "user")
HEADERS = ["preference", "placement", "met", "form", "answers", "n"]


def first_of_each(people: str) -> dict[str, User]:
    """The first person of each preference `WANTED` has in the people file `people`, by preference
    (one person a preference: the rule is theirs)."""
    firsts: dict[str, User] = {}
    for name, preference, _ in people_from(people).values():
        if preference.kind in WANTED:
            firsts.setdefault(preference.kind, User(name, preference, seed=0))
    return firsts


def asked(user: User, placement: str) -> Asked:
    if placement == "none":
        return Asked(user.system)
    return Asked(user.system, (ASPECTS[WANTED[user.preference.kind]],), MemoryConfig(placement=placement))


async def measure(model, tokenizer, user: User, placement: str, questions: list[str], args) -> dict:
    chats = [asked(user, placement).chat(q) for q in questions]
    replies, asked_again = [], []
    for seed in args.seeds:
        ids = await sample(model, tokenizer, chats, args, first_seed=seed)
        replies += [tokenizer.decode(reply, skip_special_tokens=True) for reply in ids]
        asked_again += questions
    return {"preference": user.preference.kind, "placement": placement,
            "met": fmean(user.satisfied(r, q) for r, q in zip(replies, asked_again)),
            "form": fmean(user.preference.rule(r, user.name) for r in replies),
            "answers": fmean(answers(q, r) for r, q in zip(replies, asked_again)), "n": len(replies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", default="bench/data/people_heldout.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=len(TRAIN_QUESTIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1000])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--name", default="memory_placement")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.models import load_model

    started = time.monotonic()
    model, tokenizer = load_model(args.model)
    firsts = first_of_each(args.people)
    questions = list(TRAIN_QUESTIONS)[:args.questions]
    rows = [asyncio.run(measure(model, tokenizer, user, placement, questions, args))
            for user in firsts.values() for placement in PLACEMENTS]
    means = [{"preference": "mean", "placement": placement, "n": sum(r["n"] for r in rows if r["placement"] == placement),
              **{k: fmean(r[k] for r in rows if r["placement"] == placement) for k in ("met", "form", "answers")}}
             for placement in PLACEMENTS]
    print(table(HEADERS, [[r[h] for h in HEADERS] for r in rows + means]))
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "wall_s": round(time.monotonic() - started, 1),
                                    "rows": rows, "means": means})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
