"""Whether a personal-agent trial's replies to new questions still answer them, as a careful
reader finds, not by the bench's rule.

The personal-agent bench counts a held-out reply as answering when it shares a content word with
the question and is not one word over and over (`flywheel/drills/simulated_people.answers`). On
240 pairs a helper wrote (bench/judge_answers.py) that rule passes 0.53 of the replies that
answer (0.40 of short answers, none of the one-word or numeric ones): a policy that learns to
answer briefly is read as answering less. So this takes the replies a trial's final policy gives
to the held-out questions, and the base's, exactly as the bench sampled them (the same seeds,
temperature, person and served instructions; and the base's with those instructions, where the bench
measured it: how much of a fall is the served memory's), for a reader who did not train or tune
anything to label.

    .venv/bin/python bench/heldout_answers.py export --results NAME --run-root runs/bench_unscripted \
        --people bench/data/people_heldout_2.json        # writes bench/data/NAME_replies.jsonl (+ a key)
    # a reader adds "answers": true|false to every line of the replies file, blind to trial and arm
    .venv/bin/python bench/heldout_answers.py score --results NAME   # the shares, into bench/results/NAME_answers.json

The replies file holds the question and the reply only, shuffled; which trial and which model
wrote each is in the key file. `export` checks that the bench's rule gives the same share on
these replies as the results file holds (the same replies, not new ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, write_result  # noqa: E402

RECORDED = {"before": "heldout_before", "after": "heldout", "base_served": "heldout_base_served",
            "untold": "heldout_untold"}
"""Each policy's replies and the results field that holds their rule's share: the base, the trial's
final policy (with what the gateway served the person at the end, where it served anything), the
base with what was served, and the final policy without it (a trained trial with a served memory)."""


def files(name: str) -> tuple[Path, Path]:
    return ROOT / "bench/data" / f"{name}_replies.jsonl", ROOT / "bench/data" / f"{name}_replies_key.json"


async def export(args) -> None:
    from bench.lib.final_policy import final_policy
    from bench.lib.personal_eval import sample
    from flywheel.config import load_config
    from flywheel.drills.personal_agent import Asked, opening_of
    from flywheel.drills.simulated_people import (
        HELD_OUT_QUESTIONS,
        User,
        answers,
        people_from,
    )
    from flywheel.models import load_model, load_weights

    results = json.loads((RESULTS / f"{args.results}.json").read_text())
    bench_args = argparse.Namespace(**results["args"])
    people = people_from(args.people)
    items, key = [], {}
    for trial in results["trials"]:
        run_dir = Path(args.run_root) / f"{trial['arm']}-{trial['pref']}-{trial['trial']}"
        config = load_config(str(run_dir / "config.yaml"), [])
        if trial.get("memory") is not None or (config.memory.enabled and "served" not in trial):
            raise SystemExit(f"{run_dir.name}: its replies were asked with a memory this results file does not hold "
                             "(the app's memory keeps a file's people's words out of it; a served memory before the "
                             "bench recorded `served`)")
        name, preference, voice = people[f"{trial['pref']}-{trial['trial'] + 1}"]
        user = User(name, preference, seed=trial["seed"], voice=voice)
        asked = [q for q in HELD_OUT_QUESTIONS for _ in range(bench_args.heldout_samples)]
        served = Asked(user.system, tuple(trial.get("served") or ()), config.memory)
        policies = [("before", None, Asked(user.system)), ("after", final_policy(config, run_dir), served)]
        if trial.get("heldout_base_served"):
            policies.append(("base_served", None, served))
        if trial.get("heldout_untold"):
            policies.append(("untold", policies[1][1], replace(served, instructions=())))
        for when, weights, put in policies:
            chats = [put.chat(q) for q in asked]
            model, tokenizer = load_model(config.model)
            if weights is not None:
                load_weights(model, weights)
            replies = [opening_of(chat) + tokenizer.decode(ids, skip_special_tokens=True)
                       for chat, ids in zip(chats, await sample(model, tokenizer, chats, bench_args))]
            recorded = trial[RECORDED[when]]["answers"]
            rule = fmean(answers(q, r) for q, r in zip(asked, replies))
            if abs(rule - recorded) > 1e-9:
                raise SystemExit(f"{run_dir.name} {when}: the rule gives {rule:.3f} here, {recorded:.3f} in the results: not the same replies")
            for question, reply in zip(asked, replies):
                items.append({"question": question, "reply": reply})
                key[len(items) - 1] = {"trial": f"{trial['pref']}:{trial['trial']}", "when": when,
                                       "rule": answers(question, reply)}
    for_reader(items, key, args.results)


def for_reader(items: list[dict], key: dict[int, dict], name: str) -> None:
    """`items` (question and reply) shuffled into NAME's replies file, for a reader blind to where
    each came from, and what `key` says of each into its key file."""
    order = list(range(len(items)))
    random.Random(0).shuffle(order)
    replies_file, key_file = files(name)
    replies_file.write_text("".join(json.dumps({"id": i, **items[j]}, ensure_ascii=False) + "\n"
                                    for i, j in enumerate(order)))
    key_file.write_text(json.dumps({i: key[j] for i, j in enumerate(order)}, indent=1) + "\n")
    print(f"wrote {len(items)} replies to {replies_file} and their key to {key_file}")


def labelled(name: str) -> list[dict]:
    """The replies of results `name` a reader labelled, each with its trial, policy (`when`) and the
    rule's reading from the key."""
    replies_file, key_file = files(name)
    items = [json.loads(line) for line in replies_file.read_text(encoding="utf-8").splitlines()]
    key = json.loads(key_file.read_text(encoding="utf-8"))
    if {str(i["id"]) for i in items} != set(key) or not all(isinstance(i.get("answers"), bool) for i in items):
        raise SystemExit(f"{replies_file}: every reply needs an `answers` label of true or false")
    return [{**item, **key[str(item["id"])]} for item in items]


def score(args) -> None:
    items = labelled(args.results)
    rows = {}
    for trial in sorted({i["trial"] for i in items}):
        row = {}
        for when in RECORDED:
            if group := [i for i in items if i["trial"] == trial and i["when"] == when]:
                row[when] = {"reader": fmean(i["answers"] for i in group), "rule": fmean(i["rule"] for i in group),
                             "n": len(group)}
        rows[trial] = row
        print(f"{trial:12s} " + "   ".join(f"{when} reader {r['reader']:.2f} rule {r['rule']:.2f}" for when, r in row.items())
              + f"   (n {row['after']['n']})")
    print(f"wrote {write_result(f'{args.results}_answers', {'args': vars(args), 'trials': rows})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["export", "score"])
    parser.add_argument("--results", required=True, help="the personal-agent results file's name")
    parser.add_argument("--run-root", default="runs/bench_unscripted")
    parser.add_argument("--people", default=str(ROOT / "bench/data/people_heldout_2.json"))
    args = parser.parse_args()
    if args.mode == "export":
        asyncio.run(export(args))
    else:
        score(args)


if __name__ == "__main__":
    main()
