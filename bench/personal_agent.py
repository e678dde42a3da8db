"""Evidence 3, "it learns from being used": a personal agent aligns to its user's hidden
preference from nothing but the conversation (OpenClaw-RL's personal-agent experiment).

What runs
    For each (arm, preference, trial): a fresh deployment of the whole platform (serve with
    hot swaps, collect, the `next_state` rule judge and its hint teacher, train; Ray actors over
    the bus, configs/personal_agent.yaml) on a fresh SmolLM2-135M. A simulated person
    (flywheel/drills/simulated_people.py: a name, a hidden preference checked by a
    deterministic rule) talks to it with the official `openai` client, one `X-Session-Id` per
    conversation and nothing else: no rewards, no feedback API, no other header. A session is one everyday question, the
    first reply, the person's reaction (a correction in words when the reply misses the
    preference, thanks or a new question when it meets it) and the reply to that; with
    `--reactions 2` the person also reacts to that second reply unless they had said thanks (a
    second next state to judge: thanks once it meets the preference, else a correction or a
    complaint), and gets a third reply. Then the person goes quiet and the collector closes the
    session. Like a person who comes back later, the
    next session starts once the previous one has been trained and its version swapped in
    (`--pace free` does not wait).

Arms: `none` (serve, collect and judge only: the base model), `rl` (next-state RL: the judge's
±1 from the person's reaction), `opd` (hint distillation only: the teacher, the pinned starting
model told the correction, scores the tokens sampled, and gives its distribution at each of
them), `both`, `memory` (nothing trains: the app keeps the hints the judge's reader finds and
puts them in the system message, OpenClaw-RL's memory baseline; with `judge.teacher.wishes`
`instead`, what they ask for, as the teacher would be told it). `--memory` gives a training arm
the app's memory too: the person's adapter learns with those hints in its prompts. `served`: the
platform keeps that memory itself (`memory.enabled`: the judge reads the instructions, the
gateway puts them in the person's requests, `memory.placement`; `memory.enabled=true` gives a
training arm it).

People: by default the drill's own (flywheel/drills/simulated_people.py, phrasings written with
the rules); `--people bench/data/people_heldout.json` takes trial i of a preference's person
`PREF-(i+1)` from a file written by a helper from a brief, whose words the judge's author never
read (three people per preference: brief, bullets, name, formal).

Measured
    - sessions to learn, as OpenClaw-RL counts it: the session at which the first replies have
      satisfied the preference in 3 consecutive sessions (capped at `--cap`; `>cap` = not
      learned). A reply satisfies it only if it also answers the question (the person's
      `answers` check): "at most 30 words" is met by nonsense too, and a policy that collapses
      into repeating its system message must not count as aligned. The rule is a weak measure of
      answering (passes the base's replies 0.96-1.00 where a reader passes 0.33-0.46; too strict on
      short answers): `bench/heldout_answers.py` has a reader label the held-out replies instead;
    - the held-out satisfaction rate of the final weights on questions never asked in a trial
      (`HELD_OUT_QUESTIONS`, `--heldout-samples` seeded samples each, the app's temperature);
      where a trained arm has a memory, also of the base with what it serves at the end
      (`heldout_base_served`: how much of the rate, and of the answers, is the person's adapter's),
      and of the final weights without what it serves (`heldout_untold`: what the adapter learned);
    - general skill kept: greedy accuracy on held-out arithmetic (bench/learn_arith.py's
      evaluation) of the base model and of each trained trial's final weights;
    - per session: the version that answered, whether it satisfied, what the judge made of the
      person's reaction (class, hint) and whether the teacher scored the turn.

Writes bench/results/NAME.json (after every trial: `--keep` continues a partial run, skipping
the trials it holds) and docs/img/NAME.png (each trial's preference rate over the last 5
sessions, and the version that answered, as versions roll in).

    .venv/bin/python bench/personal_agent.py --arms both --prefs formal --trials 1 --cap 20   # one trial, ~3-7 min
    .venv/bin/python bench/personal_agent.py       # the full grid: 4 prefs x 3 trials of both, 2 x 3 of the others
    .venv/bin/python bench/personal_agent.py --arms both --name personal_agent_lora adapters.kind=lora \
        adapters.scope=tenant actor.optimizer.lr=0.0005    # the person's own adapter on a frozen base
    .venv/bin/python bench/personal_agent.py --arms both memory --people bench/data/people_heldout.json \
        --name personal_agent_unscripted --cap 15 adapters.kind=lora adapters.scope=tenant actor.optimizer.lr=0.0005 \
        judge.teacher.memory=8                             # issue 45: people nobody here wrote, with adapters
    .venv/bin/python bench/personal_agent.py --probe-hints --people bench/data/people_heldout.json \
        --prefs brief bullets name formal --name personal_agent_unscripted   # the teacher told each person's words

With adapters (`adapters.kind=lora`) the final policy is the base with the trial's adapter merged
in (bench/lib/final_policy.py), for the same held-out and arithmetic evaluations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, START_COMMIT, machine, quiet_logs, table, write_result  # noqa: E402
from bench.lib.final_policy import final_policy  # noqa: E402
from bench.lib.personal_eval import satisfaction, wait_trained  # noqa: E402
from flywheel.drills.personal_agent import (  # noqa: E402
    ARMS,
    CONFIG,
    HEADERS,
    RUN,
    WINDOW,
    Asked,
    converse,
    judge_agreement,
    remember,
    rolling_rate,
    served_instructions,
    sessions_to_learn,
    summary_rows,
    verdicts,
    with_memory,
)
from flywheel.drills.simulated_people import (  # noqa: E402
    HELD_OUT_QUESTIONS,
    NAMES,
    PREFERENCE_ORDER,
    PREFERENCES,
    TRAIN_QUESTIONS,
    User,
    people_from,
)

DEFAULT_PREFS = {"both": ["brief", "bullets", "name", "formal"], "rl": ["brief", "name"], "opd": ["brief", "name"],
                 "none": ["brief", "name"], "memory": ["brief", "bullets", "name", "formal"],
                 "served": ["brief", "bullets", "name", "formal"]}


# ---- one trial ------------------------------------------------------------------------------

def trial_dir(arm: str, pref: str, index: int, args) -> Path:
    return ROOT / args.run_root / f"{arm}-{pref}-{index}"


def trial(arm: str, pref: str, index: int, args, progress) -> dict:
    from openai import OpenAI

    from flywheel.config import load_config
    from flywheel.deploy.deployment import Deployment

    seed = args.seed_base + 1000 * index + PREFERENCE_ORDER.index(pref)
    if args.people:
        name, preference, voice = people_from(args.people)[f"{pref}-{index + 1}"]
        user = User(name, preference, seed=seed, voice=voice)
    else:
        user = User(NAMES[seed % len(NAMES)], PREFERENCES[pref], seed=seed)
    run_dir = trial_dir(arm, pref, index, args)
    trial_id = run_dir.name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh model: nothing to resume from
    config = load_config(CONFIG, [f"run_dir={run_dir}", f"seed={seed}", *ARMS[arm], *args.overrides])
    trains = "train" in config.deploy.loops
    started = time.monotonic()
    deployment = Deployment(config).start()
    sessions: list[dict] = []
    memory: list[str] | None = [] if arm == "memory" or args.memory else None
    try:
        client = OpenAI(base_url=f"{deployment.serve_url}/v1", api_key="unused")
        stats = deployment.stats()
        for s in range(args.cap):
            sessions.append(converse(client, config.served_model, user, s, trial_id, args, memory=memory,
                                     wishes=config.judge.teacher.wishes))
            if memory is not None:
                remember(memory, sessions[-1], config.judge.next_state)
            if (trains or config.memory.enabled) and args.pace == "trained":
                stats = wait_trained(deployment, s + 1, args.wait_s)
            learned = sessions_to_learn([x["satisfied"] for x in sessions], RUN)
            progress(arm, pref, index, user, sessions, stats, learned)
            if learned is not None and s + 1 >= learned + args.after:
                break
        stats = wait_trained(deployment, len(sessions), args.wait_s)
        said = asyncio.run(verdicts(deployment.bus_url))
        served = asyncio.run(served_instructions(deployment.bus_url)) if config.memory.enabled else None
        asked = Asked(with_memory(user.system, user.name, memory or [], config.judge.teacher.wishes), tuple(served or ()),
                      config.memory)
    finally:
        deployment.stop()
    for s in sessions:
        s.update(said.get(s["id"], {}))
    weights = final_policy(config, run_dir) if trains else None
    satisfied = [s["satisfied"] for s in sessions]
    learned = sessions_to_learn(satisfied, RUN)
    return {
        "arm": arm, "pref": pref, "trial": index, "user": user.name, "seed": seed, "learned_at": learned,
        "cap": args.cap, "sessions": sessions, "satisfied_rate": fmean(satisfied), "final_version": weights and weights.name,
        "judge_agreement": judge_agreement(sessions), "hinted": sum(bool(s.get("hint")) for s in sessions),
        "unjudged": sum(s.get("judge_score") is None for s in sessions),
        "taught": sum(bool(s.get("teacher_tokens")) for s in sessions), "trial_s": round(time.monotonic() - started, 1),
        "weights": str(weights) if weights else None, "stats": {k: v for k, v in stats.items() if k in ("serve", "judge", "train")},
        "memory": memory, "served": served,
        "heldout_before": asyncio.run(satisfaction(None, config.model, user, HELD_OUT_QUESTIONS, args)),
        "heldout": asyncio.run(satisfaction(weights, config.model, user, HELD_OUT_QUESTIONS, args, asked=asked)),
        "heldout_base_served": asyncio.run(satisfaction(None, config.model, user, HELD_OUT_QUESTIONS, args, asked=asked))
        if weights and asked != Asked(user.system, memory=config.memory) else None,
        "heldout_untold": asyncio.run(satisfaction(weights, config.model, user, HELD_OUT_QUESTIONS, args,
                                                   asked=replace(asked, instructions=()))) if weights and served else None,
    }


UNREAD = ("said", "said_again", "hint", "second_hint")
"""A session's fields that hold a file's people's words (their reactions, the hints read in them)."""


def scrubbed(result: dict) -> dict:
    """A trial of a file's people without their words (kept unread: bench/data/people_heldout.json
    measures a reader its author must not tune to them): whether each was a hint, how long each was."""
    sessions = [{k: v for k, v in s.items() if k not in UNREAD}
                | {f"{k}_chars": len(s[k]) for k in UNREAD if isinstance(s.get(k), str)} for s in result["sessions"]]
    return {**result, "sessions": sessions, "memory": None if result.get("memory") is None else len(result["memory"])}


def probe_hints(prefs: list[str], args) -> list[list]:
    """Whether the hint can teach at all: per preference, the base model's satisfaction rate on the
    training questions, and the teacher's (the same model told a specific correction as its hint).
    With `--people`: per person of the file (trial i's person of each preference), the teacher told
    each of `--probe-corrections` of the person's own corrections in turn, or all of them at once
    with `--probe-together` (their words stay unread: only rates are shown)."""
    rows = []
    for pref in prefs:
        if not args.people:
            user = User(NAMES[0], PREFERENCES[pref], seed=0)
            hints = [PREFERENCES[pref].specific[0].format(name=user.name)]
            people = [(pref, user, hints, hints[0])]
        else:
            file = people_from(args.people)
            people = []
            for index in range(args.trials):
                name, preference, voice = file[f"{pref}-{index + 1}"]
                user = User(name, preference, seed=index, voice=voice)
                hints = user.rng.sample(voice.corrections, min(args.probe_corrections, len(voice.corrections)))
                people.append((f"{pref}-{index + 1}", user, hints,
                               f"{len(hints)} of their corrections{' together' if args.probe_together else ''}"))
        for who, user, hints, shown in people:
            questions = TRAIN_QUESTIONS[:args.probe_questions]
            base = asyncio.run(satisfaction(None, args.model, user, questions, args))
            row = [who, shown, base["rate"]]
            for mode in args.probe_wishes:  # what the teacher is told of each hint (judge.teacher.wishes)
                told_as = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, f"judge.teacher.wishes={mode}"]})
                told = [asyncio.run(satisfaction(None, args.model, user, questions, told_as, hint))
                        for hint in ([hints] if args.probe_together else hints)]
                row += [fmean(t["rate"] for t in told), fmean(t["answers"] for t in told)]
            rows.append(row)
            print(f"{who}: base {base['rate']:.2f}, told " + ", ".join(
                f"{mode} {rate:.2f}" for mode, rate in zip(args.probe_wishes, row[3::2])) + f" ({shown})", flush=True)
    return rows


def arithmetic(weights: str | None, args) -> float:
    from bench.learn_arith import accuracy
    from flywheel.config import load_config
    from flywheel.envs import make_env

    config = load_config("configs/arith_smollm2.yaml", [])
    env = make_env(config.rollout.env, config.rollout.env_args)
    return asyncio.run(accuracy(weights and Path(weights), config.model, env, args.arith_problems,
                                config.rollout.sampling.max_new_tokens))["accuracy"]


# ---- live progress, the table, the plot -----------------------------------------------------

def progress(arm: str, pref: str, index: int, user: User, sessions: list[dict], stats: dict, learned: int | None) -> None:
    last, train = sessions[-1], stats.get("train") or {}
    metrics = train.get("last") or {}
    streak = next((i for i, s in enumerate(reversed(sessions)) if not s["satisfied"]), len(sessions))
    print(f"[{arm:4} {pref:12} #{index}] session {len(sessions):2}  v{last['version']}  "
          f"{'meets' if last['satisfied'] else 'misses'} {user.preference.kind:12} rate(last {WINDOW})="
          f"{rolling_rate([s['satisfied'] for s in sessions])[-1]:.2f} streak={streak}"
          f"{f'  LEARNED at {learned}' if learned else ''}  | trained={train.get('samples', '-')} "
          f"taught={metrics.get('opd_topk_tokens') or metrics.get('opd_tokens', '-')} loss={metrics.get('loss') or 0:.3f}  "
          + ("" if user.voice else f"said: {last['said'][:48]!r}"), flush=True)  # a file's people's words stay unread


def plot(trials: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefs = sorted({t["pref"] for t in trials})
    fig, axes = plt.subplots(2, len(prefs), figsize=(max(6.0, 4.2 * len(prefs)), 6), squeeze=False, sharex=True)
    colors = {"none": "tab:gray", "rl": "tab:blue", "opd": "tab:orange", "both": "tab:green", "memory": "tab:purple",
              "served": "tab:brown"}
    for col, pref in enumerate(prefs):
        rate, version = axes[0][col], axes[1][col]
        for arm in (arm for arm in colors if any(t["arm"] == arm and t["pref"] == pref for t in trials)):
            mine = [t for t in trials if t["arm"] == arm and t["pref"] == pref]
            learned = sorted(t["learned_at"] for t in mine if t["learned_at"])
            label = f"{arm}: learned in {len(learned)} of {len(mine)}" + (f" (at {', '.join(map(str, learned))})" if learned else "")
            for i, t in enumerate(mine):  # a line per trial, a dot where it met the preference 3 times in a row
                x = [s["session"] + 1 for s in t["sessions"]]
                y = rolling_rate([s["satisfied"] for s in t["sessions"]])
                rate.plot(x, y, color=colors[arm], alpha=0.7, linewidth=1.2, label=None if i else label)
                if t["learned_at"]:
                    rate.plot(t["learned_at"], y[x.index(t["learned_at"])], "o", color=colors[arm], markersize=5)
                version.step(x, [s["version"] for s in t["sessions"]], where="post", color=colors[arm], alpha=0.7)
        rate.set_title(f"{pref}: first replies meeting it (last {WINDOW} sessions)", fontsize=9)
        rate.set_ylim(-0.05, 1.05)
        rate.legend(fontsize=7)
        version.set_xlabel("session")
        version.set_ylabel("version that answered")
    fig.suptitle("A personal agent (SmolLM2-135M, live) learning its user's preference", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--prefs", nargs="+", choices=sorted(PREFERENCES), help="default: 4 for both, 2 for the others")
    parser.add_argument("--trials", type=int, default=3, help="trials per (arm, preference)")
    parser.add_argument("--only", nargs="+", default=None, metavar="PREF:TRIAL",
                        help="run only these trials (e.g. formal:2), each with its own person and seed")
    parser.add_argument("--cap", type=int, default=60, help="sessions at most per trial")
    parser.add_argument("--seed-base", type=int, default=0,
                        help="added to every trial's seed: the same people again, their own draws and the platform's")
    parser.add_argument("--after", type=int, default=0, help="sessions to go on once learned (for the curve)")
    parser.add_argument("--pace", choices=("trained", "free"), default="trained")
    parser.add_argument("--wait-s", type=float, default=180.0, help="longest wait for a session to be trained")
    parser.add_argument("--memory", action="store_true",
                        help="every arm with the memory arm's app memory: the hints it keeps in the system message")
    parser.add_argument("--reactions", type=int, choices=(1, 2), default=1,
                        help="2: the person also reacts to the second reply (unless they had said thanks)")
    parser.add_argument("--people", help="a people file (JSON); default: the drill's own people")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--heldout-samples", type=int, default=2)
    parser.add_argument("--arith-problems", type=int, default=50)
    parser.add_argument("--run-root", default="runs/bench_personal_agent")
    parser.add_argument("--name", default="personal_agent", help="bench/results/NAME.json and docs/img/NAME.png "
                        "(NAME begins personal_agent: bench/README.md)")
    parser.add_argument("--keep", action="store_true", help="continue the results file: skip the trials it holds")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each trial's weight versions and checkpoints under --run-root (~2.7 GB a trial)")
    parser.add_argument("--report", action="store_true", help="only print the table and draw the plot of the results file")
    parser.add_argument("--probe-hints", action="store_true",
                        help="only measure, per preference, the base model's and the hint teacher's satisfaction rates "
                             "(the teacher as configured, overrides included: e.g. judge.teacher.hint_template)")
    parser.add_argument("--model", default="smollm2-135m", help="the model --probe-hints measures")
    parser.add_argument("--probe-questions", type=int, default=16, help="training questions --probe-hints asks")
    parser.add_argument("--probe-corrections", type=int, default=3, help="with --people: corrections told per person")
    parser.add_argument("--probe-together", action="store_true",
                        help="tell the teacher the person's corrections all at once, as its memory does, not each in turn")
    parser.add_argument("--probe-wishes", nargs="+", default=["words"], choices=("words", "beside", "instead"),
                        help="what --probe-hints tells the teacher of each hint (judge.teacher.wishes), each in turn")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every deployment")
    args = parser.parse_args()
    quiet_logs()
    if args.probe_hints:
        prefs = args.prefs or sorted(PREFERENCES)
        rows = probe_hints(prefs, args)
        print(table(["person" if args.people else "preference", "hint", "base rate",
                     *(f"{what} ({mode})" for mode in args.probe_wishes for what in ("told", "answers"))], rows))
        write_result(f"{args.name}_hints", {"args": vars(args), "rows": rows})
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    path = RESULTS / f"{args.name}.json"
    previous = json.loads(path.read_text()) if (args.keep or args.report) and path.exists() else {}
    trials: list[dict] = previous.get("trials", [])
    for kept in trials:  # a continued file mixes commits: each trial says its own
        kept.setdefault("commit", previous.get("commit"))
    arith_before = previous.get("arith_before")
    if args.report:
        args.arms = []  # nothing to run
    started = time.monotonic()
    import ray

    from flywheel.deploy.deployment import LOCAL_RAY_ENV, RAY_ENV

    for key, value in {**RAY_ENV, **LOCAL_RAY_ENV}.items():
        os.environ.setdefault(key, value)
    if args.arms:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # one Ray for every trial's deployment
    try:
        if arith_before is None and args.arith_problems and args.arms:
            arith_before = arithmetic(None, args)
            print(f"held-out arithmetic, base model: {arith_before:.3f}", flush=True)
        for arm in args.arms:
            for pref in args.prefs or DEFAULT_PREFS[arm]:
                for index in range(args.trials):
                    if any((t["arm"], t["pref"], t["trial"]) == (arm, pref, index) for t in trials):
                        continue
                    if args.only is not None and f"{pref}:{index}" not in args.only:
                        continue
                    result = trial(arm, pref, index, args, progress)
                    if result["weights"] and args.arith_problems:
                        result["arith_after"] = arithmetic(result["weights"], args)
                    if not args.keep_weights:  # ~2.7 GB a trial, not needed once measured
                        for heavy in ("weights", "checkpoints", "merged"):
                            shutil.rmtree(trial_dir(arm, pref, index, args) / heavy, ignore_errors=True)
                    trials.append({**(scrubbed(result) if args.people else result), "commit": START_COMMIT})
                    print(f"== {arm} {pref} #{index}: learned at {result['learned_at'] or f'>{args.cap}'}, held-out rate "
                          f"{result['heldout']['rate']:.2f}, arithmetic {result.get('arith_after')}, first replies not judged "
                          f"{result['unjudged']}, {result['trial_s']:.0f} s",
                          flush=True)
                    write_result(args.name, {"args": vars(args), "machine": machine(1), "arith_before": arith_before,
                                             "wall_s": previous.get("wall_s", 0) + time.monotonic() - started,
                                             "table": summary_rows(trials, arith_before), "trials": trials})
    finally:
        ray.shutdown()
    print(table(HEADERS, summary_rows(trials, arith_before)))
    if trials:
        plot(trials, ROOT / "docs" / "img" / f"{args.name}.png")


if __name__ == "__main__":
    main()
