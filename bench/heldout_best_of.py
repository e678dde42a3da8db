"""Issue 45: whether the replies a person is *served* once a personal-agent trial ends answer new
questions, where the gateway serves the best of k (`memory.best_of`, flywheel/serve/best_of.py).

The personal-agent bench's held-out figures are of one sampled reply a question
(bench/personal_agent.py: `heldout`, the final adapter with the instructions served at the end).
With `memory.best_of` the person is served the reply the gateway picks of k, so "the share of
replies that answer the question asked" is the share of those. This re-asks the held-out questions
of each trial of a results file whose final adapter version is still in its run's adapter store (a
later run of the same trial replaces the store; the results file says which version the trial ended
on), the person and the served instructions as at the trial's end, `--k` draws a question (seeds 0,
1000, ...: the app's temperature and max_tokens, `--heldout-samples` a question as the bench), of:

- `before`: the base, nothing served (the person's first replies; one reply is served);
- `base served`: the base with the instructions (the served memory alone, nothing trained);
- `adapter served`: the trial's final adapter, merged, with them;

each as `single` (every draw as it comes), and as the gateway serves `best of 2` (the first two
draws) and `best of K` (all): `wish_checks.best`, each reply's information about the request read
by the frozen base as the gateway reads it with adapters. Where nothing is served, the gateway
serves one reply: the first draw. `met` = the person's
rule (answers and meets the wish); `answers` = the bench's rule. With `--export` the replies go to
a reader blind to trial and policy (`export`); `--score` reads the labels back (`score`). With
`--phrased-now`, also `adapter served, phrased now`: the same adapter served the instructions as
the judge serves them now: `ASPECTS` phrasing each aspect (bench/instruction_phrasings.py), none
for an `UNSERVED` one; exported beside the others.

    .venv/bin/python bench/heldout_best_of.py --results personal_agent_unscripted2_best_of2 \
        personal_agent_unscripted2_best_of2_dense --run-root runs/bench_unscripted \
        --people bench/data/people_heldout_2.json --name NAME --export
    # a reader adds "answers": true|false to every line of bench/data/NAME_replies.jsonl
    .venv/bin/python bench/heldout_best_of.py --results ... --name NAME --score
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

from bench.heldout_answers import files, for_reader  # noqa: E402
from bench.lib.common import RESULTS, machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.personal_eval import information, sample, served  # noqa: E402
from flywheel.drills.personal_agent import opening_of  # noqa: E402
from flywheel.drills.simulated_people import answers  # noqa: E402

POLICIES = ("before", "base served", "adapter served")
NOW = "adapter served, phrased now"
"""With `--phrased-now`: the adapter served the instructions as the judge serves them now."""
PICKS = ("single", "best of 2", "best of K")
FORMER = {"no_preamble": "Start with the answer itself: no introduction, no restating the question, no filler."}
"""Instructions as earlier commits phrased them (flywheel/judge/wishes.py `ASPECTS`), by aspect, so
that the trials run then map to their aspects."""


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
    from flywheel.drills.simulated_people import HELD_OUT_QUESTIONS

    questions = [q for q in HELD_OUT_QUESTIONS for _ in range(args.heldout_samples)]
    chats = [asked.chat(q) for q in questions]
    drawn = [asyncio.run(sample(policy, tokenizer, chats, args, first_seed=1000 * k)) for k in range(args.k)]
    met: dict[str, list[bool]] = {pick: [] for pick in PICKS}
    answering: dict[str, list[bool]] = {pick: [] for pick in PICKS}
    asked_so = []
    for i, (question, chat) in enumerate(zip(questions, chats)):
        replies = [draw[i] for draw in drawn]
        texts = [opening_of(chat) + tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        picks = {"single": range(len(texts)), "best of 2": [0], "best of K": [0]}
        if asked.instructions:
            gains = information(scorer, tokenizer, chat, list(asked.served(question).instructions), replies)
            picks |= {"best of 2": [served(aspects, texts[:2], gains[:2], chat)],
                      "best of K": [served(aspects, texts, gains, chat)]}
        for pick, chosen in picks.items():
            met[pick] += [user.satisfied(texts[j], question) for j in chosen]
            answering[pick] += [answers(question, texts[j]) for j in chosen]
        asked_so.append({"question": question, "replies": texts[:2], "served": picks["best of 2"][0]})
    return {"met": {pick: fmean(v) for pick, v in met.items()},
            "answers": {pick: fmean(v) for pick, v in answering.items()},
            "questions": len(questions), "replies": asked_so}


def export(rows: list[dict], name: str) -> None:
    """For a reader blind to trial and policy: the question and reply of the base's first draws
    (`before`) and of the adapter's two draws with what was served (`single`; `best of 2` the one
    the gateway serves), for each trial that ended with instructions served; shuffled, with a key."""
    items, key = [], {}
    for row in rows:
        if not row["aspects"]:
            continue
        for policy, draws in (("before", 1), ("adapter served", 2), (NOW, 2)):
            for asked in row.get(policy, {}).get("replies", ()):
                for j, reply in enumerate(asked["replies"][:draws]):
                    items.append({"question": asked["question"], "reply": reply})
                    key[len(items) - 1] = {"trial": row["trial"], "policy": policy, "served": j == asked["served"],
                                           "rule": answers(asked["question"], reply)}
    for_reader(items, key, name)


def score(name: str) -> None:
    """The reader's share of answers, by trial: before, the adapter's draws, the one served of two."""
    items = [json.loads(line) for line in files(name)[0].read_text(encoding="utf-8").splitlines()]
    key = json.loads(files(name)[1].read_text(encoding="utf-8"))
    if {str(i["id"]) for i in items} != set(key) or not all(isinstance(i.get("answers"), bool) for i in items):
        raise SystemExit(f"{files(name)[0]}: every reply needs an `answers` label of true or false")
    labelled = [{**item, **key[str(item["id"])]} for item in items]
    groups = {"before": lambda i: i["policy"] == "before", "single": lambda i: i["policy"] == "adapter served",
              "best of 2": lambda i: i["policy"] == "adapter served" and i["served"],
              "single, now": lambda i: i["policy"] == NOW, "best of 2, now": lambda i: i["policy"] == NOW and i["served"]}
    if not any(i["policy"] == NOW for i in labelled):
        groups = dict(list(groups.items())[:3])
    def shares(chosen: list[dict]) -> dict:
        return {g: {by: fmean(i[by] for i in chosen if keep(i)) for by in ("answers", "rule")}
                for g, keep in groups.items()}

    trials = sorted({i["trial"] for i in labelled})
    rows = {trial: shares([i for i in labelled if i["trial"] == trial]) for trial in trials}
    rows["all"] = shares(labelled)
    print(table(["trial", *(f"{g}: reader / rule" for g in groups)],
                [[t, *(f"{r[g]['answers']:.2f} / {r[g]['rule']:.2f}" for g in groups)] for t, r in rows.items()]))
    print(f"wrote {write_result(f'{name}_answers', {'trials': rows})}")


def trial(entry: dict, config_memory, people: dict, args) -> dict | None:
    """One trial's three policies, or None where its final adapter is no longer kept."""
    from peft import PeftModel

    from flywheel.drills.personal_agent import Asked
    from flywheel.drills.simulated_people import User
    from flywheel.judge.wishes import ASPECTS, UNSERVED
    from flywheel.models import load_model

    run_dir = Path(args.run_root) / f"{entry['arm']}-{entry['pref']}-{entry['trial']}"
    adapter = kept_adapter(run_dir, entry.get("final_version"))
    if adapter is None:
        return None
    aspect_of = {text: aspect for aspect, text in [*ASPECTS.items(), *FORMER.items()] if text}
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
    if args.phrased_now:
        now = [(aspect, ASPECTS[aspect] or text) for aspect, text in zip(aspects, instructions) if aspect not in UNSERVED]
        rows[NOW] = measure(policy, base, tokenizer, user, Asked(user.system, tuple(text for _, text in now), config_memory),
                            [aspect for aspect, _ in now], args)
    return {"trial": f"{entry['pref']}:{entry['trial']}", "adapter": entry["final_version"], "aspects": aspects, **rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", default=[],
                        help="personal-agent results files' names (same settings); a trial in a later one replaces it")
    parser.add_argument("--run-root", default="runs/bench_unscripted")
    parser.add_argument("--people", default="bench/data/people_heldout_2.json")
    parser.add_argument("--only", nargs="+", default=None, metavar="PREF:TRIAL")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--name", default="heldout_best_of")
    parser.add_argument("--export", action="store_true", help="also write the replies for a reader (see `export`)")
    parser.add_argument("--phrased-now", action="store_true",
                        help=f"also the adapter served the instructions as phrased now ({NOW!r})")
    parser.add_argument("--score", action="store_true", help="only score the reader's labels of NAME's replies")
    args = parser.parse_args()
    if args.score:
        return score(args.name)
    if not args.results:
        parser.error("--results: the personal-agent results files to measure")
    quiet_logs()
    from flywheel.config import load_config
    from flywheel.drills.personal_agent import CONFIG
    from flywheel.drills.simulated_people import people_from

    started = time.monotonic()
    runs = [json.loads((RESULTS / f"{name}.json").read_text()) for name in args.results]
    if any(run["args"]["overrides"] != runs[0]["args"]["overrides"] for run in runs):
        raise SystemExit("the results files were run with different settings")
    for key in ("max_tokens", "temperature", "heldout_samples"):
        setattr(args, key, runs[0]["args"][key])
    args.model = "smollm2-135m"
    config = load_config(CONFIG, runs[0]["args"]["overrides"])
    people = people_from(args.people)
    latest = {f"{t['pref']}:{t['trial']}": t for run in runs for t in run["trials"]}
    policies = (*POLICIES, NOW) if args.phrased_now else POLICIES
    rows, missing = [], []
    for key, entry in latest.items():
        if args.only and key not in args.only:
            continue
        row = trial(entry, config.memory, people, args)
        (rows.append(row) if row else missing.append(key))
        if row:
            print(key, {p: (round(row[p]["met"]["best of 2"], 2), round(row[p]["answers"]["best of 2"], 2))
                        for p in policies}, flush=True)
    mean = {p: {part: {pick: fmean(r[p][part][pick] for r in rows) for pick in PICKS} for part in ("met", "answers")}
            for p in policies}
    columns = [(part, pick) for part in ("met", "answers") for pick in PICKS]
    print(table(["policy", *(f"{part}: {pick}".replace("K", str(args.k)) for part, pick in columns)],
                [[p, *(round(mean[p][part][pick], 2) for part, pick in columns)] for p in policies]))
    print(f"{len(rows)} trials; final adapter no longer kept: {', '.join(missing) or 'none'}")
    if args.export:
        export(rows, args.name)
    for row in rows:
        for policy in policies:
            row[policy].pop("replies")
    path = write_result(args.name, {"args": vars(args), "machine": machine(None),
                                    "wall_s": round(time.monotonic() - started, 1),
                                    "trials": rows, "mean": mean, "not_kept": missing})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
