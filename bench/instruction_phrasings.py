"""Issue 45: which phrasing of a served instruction SmolLM2 follows while still answering.

The held-out readers found that the people whose corrections were read as `no_preamble` (or
`casual`) were served replies that answer half as often as the base's (docs/experiments/
learning-from-use.md, "Served replies that answer"): those instructions were written, not measured
(flywheel/judge/wishes.py `ASPECTS`). This asks the base model the training questions (never the
held-out ones) as the gateway serves them with each candidate instruction (`memory.placement` as
the bench's configuration places it, the drill's first person), `--samples` seeded draws each, the
app's temperature and max_tokens, and reads each reply:

- `answers (rule)`: the bench's rule (a content word of the question, not one word over and over);
- `says`: how much likelier the request makes the reply, in nats, under the base as the gateway
  reads it (`personal_eval.information`: the request emptied, the instruction kept);
- `answers (says)`: the share of replies that say at least `wish_checks.ANSWERS_AT` of what the
  base's own replies to that question say on average, nothing told (the gateway's mark);
- `words`: the replies' mean length in words (64 new tokens at most);
- `follows`: the aspect's check where the drill has one (`no_preamble`: its `answer_first`;
  `casual`: a contraction or an exclamation mark, the opposite of the `formal` check).

The candidates are written here before they are measured; the first of each is the instruction as
`ASPECTS` had it. The bench's rule misreads answers (bench/judge_answers.py), so `--export` also
writes every reply for a reader blind to the instruction, and `--score` reads the labels back:
`answers (reader)`, and `met (reader)` where the aspect has a check (it follows and answers).

    .venv/bin/python bench/instruction_phrasings.py --aspect no_preamble casual
    .venv/bin/python bench/instruction_phrasings.py --aspect name --name NAME --export
    # a reader adds "answers": true|false to every line of bench/data/NAME_replies.jsonl
    .venv/bin/python bench/instruction_phrasings.py --name NAME --score

With `--opening` (`memory.opening`) a candidate that shows the greeting is served as the gateway
then serves it: the greeting written as the reply's opening, the model going on after it (the row
`(opened) Maya,`; `--texts` picks the candidate; `--openings` measures each opening text given,
`memory.opening_text`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.heldout_answers import for_reader, labelled  # noqa: E402
from bench.lib.common import machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import information, sample  # noqa: E402
from flywheel.bus.instructions import GREETING  # noqa: E402

CANDIDATES = {
    "no_preamble": (
        "Start with the answer itself: no introduction, no restating the question, no filler.",
        "Answer directly.",
        "Begin your reply with the answer.",
        "Answer the question first, then add details if needed.",
        "Give the answer in your first sentence.",
        "Answer right away, without an introduction.",
    ),
    "casual": (
        "Write in a warm, relaxed, friendly tone.",
        "Answer the question in a casual, friendly tone.",
        "Answer like a friend would: casual and warm.",
        "Use a friendly, relaxed tone in your answer.",
    ),
    "name": (  # a blind reader found the note's replies answer a sixth of the time (name 1, held out)
        f"Write your reply as a short note that starts with {GREETING}.",
        f"Answer the question in a short note that starts with {GREETING}.",
        f"Write your reply as a short note that starts with {GREETING} and gives the answer in its first sentence.",
        f"Start with {GREETING} then answer the question in your first sentence.",
        "Start your reply with \"Hi Maya,\" and then answer the question.",  # Maya: the person `main` asks as
        "Answer the question, and call the user Maya in your first sentence.",
    ),
}


def follows(aspect: str, text: str, name: str) -> bool:
    from flywheel.drills.simulated_people import answer_first, by_name
    from flywheel.formats.wish_checks import CHECKS

    if aspect == "name":
        return by_name(text, name)
    return answer_first(text, name) if aspect == "no_preamble" else CHECKS["formal"](text, set()) < 0


def measure(model, tokenizer, user, instruction: str | None, args, memory, untold: list[float] | None) -> dict:
    """The replies to the training questions asked with `instruction` (None: nothing told) as the
    gateway serves it under `memory` (`memory.*`), read as the module says; `untold`: the mean of
    what the base's untold replies say, per question."""
    from flywheel.drills.personal_agent import Asked, opening_of
    from flywheel.drills.simulated_people import TRAIN_QUESTIONS, answers, words
    from flywheel.formats.wish_checks import ANSWERS_AT

    questions = TRAIN_QUESTIONS[:args.questions]
    asked = Asked(user.system, (instruction,) if instruction else (), memory)
    chats = [asked.chat(q) for q in questions]
    draws = [asyncio.run(sample(model, tokenizer, chats, args, first_seed=1000 * k)) for k in range(args.samples)]
    says, rule, texts, asked_so = [], [], [], []
    for i, (question, chat) in enumerate(zip(questions, chats)):
        replies = [draw[i] for draw in draws]
        says.append(information(model, tokenizer, chat, list(asked.served(question).instructions), replies))
        texts += [opening_of(chat) + tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        rule += [answers(question, text) for text in texts[-len(replies):]]
        asked_so += [{"question": question, "reply": text} for text in texts[-len(replies):]]
    per_question = [fmean(s) for s in says]
    mark = untold or per_question
    opening = opening_of(chats[0]) if chats else ""
    return {"instruction": f"(opened) {opening}" if opening else instruction, "answers_rule": fmean(rule), "texts": texts, "asked": asked_so,
            "words": fmean(len(words(text)) for text in texts),
            "says": fmean(per_question), "per_question": per_question,
            "answers_says": fmean(s >= ANSWERS_AT * m for row, m in zip(says, mark) for s in row)}


def export(results: dict, name: str, person: str) -> None:
    """Every reply, with its question, for a reader blind to the instruction it was asked with."""
    from flywheel.drills.simulated_people import answers

    items, key = [], {}
    for aspect, rows in results.items():
        for row in rows:
            for asked in row["asked"]:
                items.append(asked)
                key[len(items) - 1] = {"aspect": aspect, "instruction": row["instruction"],
                                       "rule": answers(asked["question"], asked["reply"]),
                                       "follows": follows(aspect, asked["reply"], person)}
    for_reader(items, key, name)


def score(name: str) -> None:
    """The reader's share of answers by instruction, and the share that also follows it."""
    items = labelled(name)
    rows, results = [], {}
    asked = dict.fromkeys((i["aspect"], i["instruction"]) for i in items)
    order = {(aspect, text): n for aspect, texts in CANDIDATES.items() for n, text in enumerate(texts)}
    for aspect, instruction in sorted(asked, key=lambda pair: (pair[0], order.get(pair, -1))):
        group = [i for i in items if i["aspect"] == aspect and i["instruction"] == instruction]
        row = {"instruction": instruction, "n": len(group), "answers_reader": fmean(i["answers"] for i in group),
               "answers_rule": fmean(i["rule"] for i in group), "follows": fmean(i["follows"] for i in group),
               "met_reader": fmean(i["answers"] and i["follows"] for i in group)}
        results.setdefault(aspect, []).append(row)
        rows.append([aspect, instruction or "(nothing told)", row["n"], *(f"{row[k]:.2f}" for k in
                     ("answers_reader", "answers_rule", "follows", "met_reader"))])
    print(table(["aspect", "instruction", "n", "answers (reader)", "answers (rule)", "follows", "met (reader)"], rows))
    print(f"wrote {write_result(f'{name}_answers', results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aspect", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--texts", nargs="+", help="with one --aspect: these candidates instead of the module's")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--name", default="instruction_phrasings")
    parser.add_argument("--export", action="store_true", help="also write the replies for a reader")
    parser.add_argument("--score", action="store_true", help="only score the reader's labels of NAME's replies")
    parser.add_argument("--opening", action="store_true", help="memory.opening: a greeting asked is written as the reply's opening")
    parser.add_argument("--openings", nargs="+", help="with --opening: each of these openings (`memory.opening_text`, {name})")
    args = parser.parse_args()
    if args.score:
        return score(args.name)
    if args.openings and not args.opening:
        parser.error("--openings: with --opening")
    if args.texts and len(args.aspect) != 1:
        parser.error("--texts: name the one --aspect they phrase")
    if args.export and len(args.aspect) != 1:
        parser.error("--export: one --aspect (the untold replies would go to the reader once per aspect)")
    quiet_logs()
    from flywheel.config import load_config
    from flywheel.drills.personal_agent import CONFIG
    from flywheel.drills.simulated_people import PREFERENCES, User
    from flywheel.models import load_model

    started = time.monotonic()
    args.memory = load_config(CONFIG, ["memory.enabled=true", "memory.placement=user",
                                       f"memory.opening={str(args.opening).lower()}"]).memory
    model, tokenizer = load_model("smollm2-135m")
    user = User("Maya", PREFERENCES["brief"], seed=0)
    untold = measure(model, tokenizer, user, None, args, args.memory, None)
    memories = [type(args.memory).model_validate({**args.memory.model_dump(), "opening_text": text})
                for text in args.openings or [args.memory.opening_text]]  # each checked as the config checks it
    rows, results = [], {}
    for aspect in args.aspect:
        measured = [untold] + [measure(model, tokenizer, user, text, args, memory, untold["per_question"])
                               for memory in memories for text in args.texts or CANDIDATES[aspect]]
        for row in measured:
            row["follows"] = fmean(follows(aspect, text, user.name) for text in row["texts"])
        results[aspect] = [{k: v for k, v in row.items() if k != "texts"} for row in measured]
        rows += [[aspect, r["instruction"] or "(nothing told)", f"{r['answers_rule']:.2f}", f"{r['says']:.1f}",
                  f"{r['answers_says']:.2f}", f"{r['words']:.0f}", f"{r['follows']:.2f}"] for r in results[aspect]]
    print(table(["aspect", "instruction", "answers (rule)", "says (nats)", "answers (says)", "words", "follows"], rows))
    if args.export:
        export(results, args.name, user.name)
    for row in (row for rows_ in results.values() for row in rows_):
        row.pop("asked")
    print(f"wrote {write_result(args.name, {'args': {k: v for k, v in vars(args).items() if k != 'memory'}, **results, 'machine': machine(None), 'seconds': time.monotonic() - started})}")


if __name__ == "__main__":
    main()
