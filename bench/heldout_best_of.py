"""Issue 45: whether the replies a person is *served* once a personal-agent trial ends answer new
questions, where the gateway serves the best of k (`memory.best_of`, flywheel/serve/best_of.py).

The personal-agent bench's held-out figures are of one sampled reply a question (bench/personal_agent.py:
`heldout`, the final adapter with the instructions served at the end). With `memory.best_of` the
person is served the reply the gateway picks of k, so "the share of replies that answer the question
asked" is the share of those. This re-asks the held-out questions of each trial of a results file
whose final adapter version is still in its run's adapter store (a later run of the same trial
replaces the store; the results file says which version the trial ended on), the person and the
served instructions as at the trial's end, `--k` draws a question (seeds 0, 1000, ...: the app's
temperature and max_tokens, `--heldout-samples` a question as the bench), of:

- `before`: the base, nothing served (the person's first replies; one reply is served);
- `base served`: the base with the instructions (the served memory alone, nothing trained);
- `adapter served`: the trial's final adapter, merged, with them;

each as `single` (every draw as it comes), and as the gateway serves `best of 2` (the first two
draws) and `best of K` (all): `wish_checks.best`, each reply's information about the request read
by the frozen base as the gateway reads it with adapters. Where a rule checks none of the aspects
served (or nothing is served), the gateway serves one reply: the first draw. `met` = the person's
rule (answers and meets the wish); `answers` = the bench's rule.

    .venv/bin/python bench/heldout_best_of.py --results personal_agent_unscripted2_best_of2 \
        personal_agent_unscripted2_best_of2_dense --run-root runs/bench_unscripted \
        --people bench/data/people_heldout_2.json --name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import information, sample, served  # noqa: E402

POLICIES = ("before", "base served", "adapter served")
PICKS = ("single", "best of 2", "best of K")


def kept_adapter(run_dir: Path, final_version: str | None) -> Path | None:
    """The trial's final adapter version's directory, if its run's store still holds it."""
    from flywheel.models.adapter_store import AdapterStore

    if not final_version:
        return None
    name, version = final_version.rsplit("-v", 1)
    store = AdapterStore(run_dir / "adapters")
    return store.path(name, int(version)) if int(version) in store.versions(name) else None


def measure(policy, scorer, tokenizer, user, asked, aspects: list[str], args) -> dict:
    """`met` and `answers` of each pick of `policy`'s replies to the held-out questions, `asked` so."""
    from flywheel.bus.instructions import addressed, names_in
    from flywheel.drills.simulated_people import HELD_OUT_QUESTIONS, answers
    from flywheel.formats.wish_checks import checkable

    questions = [q for q in HELD_OUT_QUESTIONS for _ in range(args.heldout_samples)]
    chats = [asked.chat(q) for q in questions]
    drawn = [asyncio.run(sample(policy, tokenizer, chats, args, first_seed=1000 * k)) for k in range(args.k)]
    met: dict[str, list[bool]] = {pick: [] for pick in PICKS}
    answering: dict[str, list[bool]] = {pick: [] for pick in PICKS}
    for i, (question, chat) in enumerate(zip(questions, chats)):
        replies = [draw[i] for draw in drawn]
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        picks = {"single": range(len(texts)), "best of 2": [0], "best of K": [0]}
        if asked.instructions and checkable(aspects):
            placed = [addressed(text, names_in(chat)) for text in asked.instructions]
            gains = information(scorer, tokenizer, chat, placed, replies)
            picks |= {"best of 2": [served(aspects, texts[:2], gains[:2], chat)],
                      "best of K": [served(aspects, texts, gains, chat)]}
        for pick, chosen in picks.items():
            met[pick] += [user.satisfied(texts[j], question) for j in chosen]
            answering[pick] += [answers(question, texts[j]) for j in chosen]
    return {"met": {pick: fmean(v) for pick, v in met.items()}, "answers": {pick: fmean(v) for pick, v in answering.items()},
            "questions": len(questions)}


def trial(entry: dict, config_memory, people: dict, args) -> dict | None:
    """One trial's three policies, or None where its final adapter is no longer kept."""
    from peft import PeftModel

    from flywheel.drills.personal_agent import Asked
    from flywheel.drills.simulated_people import User
    from flywheel.judge.wishes import ASPECTS
    from flywheel.models import load_model

    run_dir = Path(args.run_root) / f"{entry['arm']}-{entry['pref']}-{entry['trial']}"
    adapter = kept_adapter(run_dir, entry.get("final_version"))
    if adapter is None:
        return None
    aspect_of = {text: aspect for aspect, text in ASPECTS.items() if text}
    name, preference, voice = people[f"{entry['pref']}-{entry['trial'] + 1}"]
    user = User(name, preference, seed=entry["seed"], voice=voice)
    instructions = tuple(entry.get("served") or ())
    aspects = [aspect_of.get(text, "other") for text in instructions]
    base, tokenizer = load_model(args.model)
    policy = PeftModel.from_pretrained(load_model(args.model)[0], str(adapter)).merge_and_unload()
    served_asked = Asked(user.system, instructions, config_memory)
    rows = {"before": measure(base, base, tokenizer, user, Asked(user.system), [], args),
            "base served": measure(base, base, tokenizer, user, served_asked, aspects, args),
            "adapter served": measure(policy, base, tokenizer, user, served_asked, aspects, args)}
    return {"trial": f"{entry['pref']}:{entry['trial']}", "adapter": entry["final_version"], "aspects": aspects, **rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True,
                        help="personal-agent results files' names (same settings); a trial in a later one replaces it")
    parser.add_argument("--run-root", default="runs/bench_unscripted")
    parser.add_argument("--people", default="bench/data/people_heldout_2.json")
    parser.add_argument("--only", nargs="+", default=None, metavar="PREF:TRIAL")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--name", default="heldout_best_of")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.config import load_config
    from flywheel.drills.personal_agent import CONFIG
    from flywheel.drills.simulated_people import people_from

    started = time.monotonic()
    files = [json.loads((RESULTS / f"{name}.json").read_text()) for name in args.results]
    if any(f["args"]["overrides"] != files[0]["args"]["overrides"] for f in files):
        raise SystemExit("the results files were run with different settings")
    for key in ("max_tokens", "temperature", "heldout_samples"):
        setattr(args, key, files[0]["args"][key])
    args.model = "smollm2-135m"
    config = load_config(CONFIG, files[0]["args"]["overrides"])
    people = people_from(args.people)
    latest = {f"{t['pref']}:{t['trial']}": t for results in files for t in results["trials"]}
    rows, missing = [], []
    for key, entry in latest.items():
        if args.only and key not in args.only:
            continue
        row = trial(entry, config.memory, people, args)
        (rows.append(row) if row else missing.append(key))
        if row:
            print(key, {p: (round(row[p]["met"]["best of 2"], 2), round(row[p]["answers"]["best of 2"], 2))
                        for p in POLICIES}, flush=True)
    mean = {p: {part: {pick: fmean(r[p][part][pick] for r in rows) for pick in PICKS} for part in ("met", "answers")}
            for p in POLICIES}
    print(table(["policy", *(f"{part}: {pick}".replace("K", str(args.k)) for part in ("met", "answers") for pick in PICKS)],
                [[p, *(round(mean[p][part][pick], 2) for part in ("met", "answers") for pick in PICKS)] for p in POLICIES]))
    print(f"{len(rows)} trials; final adapter no longer kept: {', '.join(missing) or 'none'}")
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "wall_s": round(time.monotonic() - started, 1),
                                    "trials": rows, "mean": mean, "not_kept": missing})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
