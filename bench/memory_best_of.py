"""Issue 45: how often a first reply meets a person's wish where the platform serves the best of k
sampled replies, ranked by the checks of that wish (`memory.best_of`, measured here before it was
built; flywheel/serve/best_of.py).

The served memory puts the instruction read in a person's corrections before their question
(`memory.placement: user`); SmolLM2-135M then meets the wish about half the time (a first reply
that answers and meets it: the personal-agent bench's measure), too seldom for three first replies
in a row (docs/experiments/learning-from-use.md). The practice already ranks sampled replies by
how much of a wish each does (`flywheel/formats/wish_checks.py`, the wish's aspect, a reply that
does not answer ranked last). This asks SmolLM2-135M the bench's training questions (`--questions`)
as one person of each preference of a people file (`--people`, written by a helper), each question
`--k` times (seeds 0, 1000, ...: the app's temperature and max_tokens), with the right instruction
before the question (`WANTED`), and scores by the person's own rule:

- `single`: each sampled reply as it comes (what is served today);
- `best of 2`, `best of K`: the reply of the first 2, or all K, that the gateway serves
  (`flywheel/formats/wish_checks.best`: the wish's checks first among those that answer as the judge
  reads it, the pointwise mutual information of reply and question under the base model above
  zero, `flywheel/judge/relevance.py`, here computed in process); the first where none answers;
- `met` (answers and meets the wish), `answers` (the bench's rule), n = questions (x K for `single`).

    .venv/bin/python bench/memory_best_of.py --people bench/data/people_heldout_2.json --name memory_best_of_heldout2
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
from bench.lib.personal_eval import information, sample, served  # noqa: E402
from bench.memory_placement import asked, first_of_each  # noqa: E402
from flywheel.bus.instructions import addressed, names_in  # noqa: E402
from flywheel.drills.simulated_people import TRAIN_QUESTIONS, User, answers  # noqa: E402

HEADERS = ["preference", "met: single", "best of 2", "best of K", "answers: single", "best of 2", "best of K", "questions"]


def measure(model, tokenizer, user: User, questions: list[str], args) -> dict:
    kind = user.preference.kind
    person = asked(user, "user")
    chats = [person.chat(q) for q in questions]
    drawn = [asyncio.run(sample(model, tokenizer, chats, args, first_seed=1000 * k)) for k in range(args.k)]
    met: dict[str, list[bool]] = {"single": [], "best of 2": [], "best of K": []}
    answering: dict[str, list[bool]] = {key: [] for key in met}
    for i, (question, chat) in enumerate(zip(questions, chats)):
        replies = [draw[i] for draw in drawn]
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        gains = information(model, tokenizer, chat, [addressed(text, names_in(chat)) for text in person.instructions],
                            replies)
        picks = {"single": range(len(texts)), "best of 2": [served([WANTED[kind]], texts[:2], gains[:2], chat)],
                 "best of K": [served([WANTED[kind]], texts, gains, chat)]}
        for key, chosen in picks.items():
            met[key] += [user.satisfied(texts[j], question) for j in chosen]
            answering[key] += [answers(question, texts[j]) for j in chosen]
    return {"preference": kind, "questions": len(questions),
            "met": {key: fmean(values) for key, values in met.items()},
            "answers": {key: fmean(values) for key, values in answering.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", default="bench/data/people_heldout.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--name", default="memory_best_of")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.models import load_model

    started = time.monotonic()
    model, tokenizer = load_model(args.model)
    firsts = first_of_each(args.people)
    questions = list(TRAIN_QUESTIONS)[:args.questions]
    rows = [measure(model, tokenizer, user, questions, args) for user in firsts.values()]
    keys = ("single", "best of 2", "best of K")
    mean = {"preference": "mean", "questions": sum(r["questions"] for r in rows),
            **{part: {key: fmean(r[part][key] for r in rows) for key in keys} for part in ("met", "answers")}}
    print(table([h.replace("K", str(args.k)) for h in HEADERS],
                [[r["preference"], *(round(r[part][key], 2) for part in ("met", "answers") for key in keys), r["questions"]]
                 for r in rows + [mean]]))
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "wall_s": round(time.monotonic() - started, 1),
                                    "rows": rows, "mean": mean})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
