"""Issue 44, evidence 5: two people with opposite wishes use one deployment at the same time.

What runs
    For each scope (`adapters.scope`: `user`, then `shared`): a fresh deployment of the whole
    platform on SmolLM2-135M with adapters (configs/personal_agent.yaml, its `both` arm, plus
    `adapters.kind=lora`), and two simulated people (flywheel/drills/simulated_people.py) who
    take turns, session by session, each naming themselves in `X-User-Id`: one wants replies of
    at most 30 words (`brief`), the other at least 40 (`detailed`). Each session is the
    personal-agent bench's (a question, the first reply, the person's reaction in words, the
    reply to that), and the next starts once it has been trained and its version serves.

    With `scope: user` each person trains their own adapter; with `shared` both train one.

Measured, per scope and person
    - each session's first reply: whether it met the person's own wish, and whether it would have
      met the other's (a reply that drifts toward the other person's wish shows there);
    - the rate of each over the first and the last `--window` sessions;
    - held-out (questions never asked, `--heldout-samples` seeded samples each): the policy each
      person ends with (their adapter merged into the base; the shared one under `shared`), the
      rate of their own wish and of the other's; with `memory.enabled=true`, asked with what the
      gateway serves that person at the end (their instructions, `served`, where `memory.placement` puts them).

How to run (from the repository root; about 20-40 min on 2 cores)
    .venv/bin/python bench/two_people.py [--wishes brief detailed] [--sessions 16] [--scopes user shared] [key=value ...]

Writes bench/results/two_people.json (another pair of wishes: two_people_<wish>_<wish>.json; or `--name`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, START_COMMIT, quiet_logs, table  # noqa: E402
from bench.lib.final_policy import final_policy  # noqa: E402
from bench.lib.personal_eval import satisfaction, wait_trained  # noqa: E402
from flywheel.drills.personal_agent import ARMS, CONFIG, Asked, converse, served_instructions  # noqa: E402
from flywheel.drills.simulated_people import (  # noqa: E402
    HELD_OUT_QUESTIONS,
    NAMES,
    PREFERENCES,
    User,
)

WISHES = ("brief", "detailed")
"""The default pair; `--wishes` names another: two of `simulated_people.PREFERENCES` that no reply
meets together, such as `bullets` (at least two list lines) and `plain` (no markdown at all), or
`name` and `no_name` (the person's own name used, or never); or two wishes that do not exclude each
other but that a reply to the other person should not show, such as `nickname` (called "Captain")
and `steps` (laid out from "Step 1")."""
LORA = ["adapters.kind=lora", "actor.optimizer.lr=0.0005"]
"""About 10x the configuration's full fine-tuning rate ("LoRA Without Regret")."""


def people(wishes: tuple[str, str]) -> list[User]:
    return [User(NAMES[i], PREFERENCES[wish], seed=100 + i) for i, wish in enumerate(wishes)]


def in_their_place(person: User, other: User) -> User:
    """The other's wish as it would apply to `person` (their own name, for `name` and `no_name`):
    what a reply to `person` that drifted toward the other's wish would meet."""
    return User(person.name, other.preference, seed=0)


def run_scope(scope: str, args) -> dict:
    from openai import OpenAI

    from flywheel.config import load_config
    from flywheel.deploy.deployment import Deployment
    from flywheel.models.adapter_names import SHARED, adapter_for

    run_dir = ROOT / args.run_root / scope
    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(CONFIG, [f"run_dir={run_dir}", *ARMS["both"], *LORA, f"adapters.scope={scope}", *args.overrides])
    pair = people(args.wishes)
    sessions: dict[str, list[dict]] = {p.name: [] for p in pair}
    started = time.monotonic()
    deployment = Deployment(config).start()
    try:
        client = OpenAI(base_url=f"{deployment.serve_url}/v1", api_key="unused")
        for s in range(args.sessions):
            for person, other in (pair, pair[::-1]):
                record = converse(client, config.served_model, person, s, f"{scope}-{person.name}", args, user_id=person.name)
                record["other_satisfied"] = in_their_place(person, other).satisfied(record["reply"], record["question"])
                sessions[person.name].append(record)
                wait_trained(deployment, sum(map(len, sessions.values())), args.wait_s)
            print(f"{scope} session {s}: " + "; ".join(
                f"{p.name} ({p.preference.kind}) own {sessions[p.name][-1]['satisfied']:d} other "
                f"{sessions[p.name][-1]['other_satisfied']:d}" for p in pair), flush=True)
        asked = {p.name: Asked(p.system, tuple(asyncio.run(served_instructions(deployment.bus_url, p.name)))
                               if config.memory.enabled else (), config.memory) for p in pair}
    finally:
        deployment.stop()
    result = {"scope": scope, "sessions": sessions, "wall_s": round(time.monotonic() - started, 1), "people": {}}
    for person, other in (pair, pair[::-1]):
        adapter = SHARED if scope == "shared" else adapter_for(scope, "open", person.name)
        weights = final_policy(config, run_dir, adapter)
        mine = sessions[person.name]
        heldout = asyncio.run(satisfaction(weights, config.model, person, HELD_OUT_QUESTIONS, args,
                                           others=(in_their_place(person, other),), asked=asked[person.name]))
        result["people"][person.name] = {
            "wish": person.preference.kind, "adapter": adapter, "served": list(asked[person.name].instructions),
            "own_first": fmean(r["satisfied"] for r in mine[:args.window]),
            "own_last": fmean(r["satisfied"] for r in mine[-args.window:]),
            "other_first": fmean(r["other_satisfied"] for r in mine[:args.window]),
            "other_last": fmean(r["other_satisfied"] for r in mine[-args.window:]),
            "heldout_own": heldout["rate"], "heldout_other": heldout["others"][other.preference.kind],
            "heldout_answers": heldout["answers"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scopes", nargs="+", default=["user", "shared"], choices=["user", "tenant", "shared"])
    parser.add_argument("--wishes", nargs=2, default=WISHES, choices=sorted(PREFERENCES), help="the two people's wishes")
    parser.add_argument("--sessions", type=int, default=16, help="sessions per person")
    parser.add_argument("--window", type=int, default=5, help="sessions in the first and last rates")
    parser.add_argument("--wait-s", type=float, default=180.0)
    parser.add_argument("--reactions", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--heldout-samples", type=int, default=2)
    parser.add_argument("--run-root", default="runs/bench_two_people")
    parser.add_argument("--name", help="the results file's name (default: two_people, or two_people_<wish>_<wish>)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    quiet_logs()
    results = [run_scope(scope, args) for scope in args.scopes]
    rows = [[r["scope"], name, p["wish"], p["own_first"], p["own_last"], p["other_first"], p["other_last"],
             p["heldout_own"], p["heldout_other"], p["heldout_answers"]]
            for r in results for name, p in r["people"].items()]
    print(table(["scope", "person", "wish", "own, first", "own, last", "other's, first", "other's, last",
                 "held-out own", "held-out other's", "answers"], rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = args.name or ("two_people" if tuple(args.wishes) == WISHES else f"two_people_{'_'.join(args.wishes)}")
    (RESULTS / f"{name}.json").write_text(json.dumps({"commit": START_COMMIT, "args": vars(args), "results": results},
                                                        indent=2))


if __name__ == "__main__":
    main()
