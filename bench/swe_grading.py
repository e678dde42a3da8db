"""SWE grading is right: over a task set, gold patches resolve every task and wrong patches none.

What it measures
    For each task of a task set (all, or a seeded sample of `--sample` tasks), `flywheel.envs.swe.grade`
    is called, in bubblewrap sandboxes (`--jobs` at a time), with five candidate diffs:

      gold        the task's own `patch`                                      expected reward 1
      empty       no change                                                   expected 0
      other_gold  the gold patch of another task of the same project          expected 0
                  (usually does not apply: it reverts a bug this tree lacks)
      unrelated   a one-line change to the buggy file, > 20 lines from the    expected 0
                  bug (another mutation site of that file, made by the engine)
      test_edit   a root conftest.py that marks every test passed, plus an    expected 0
                  edit of the failing test's file (grading drops test files)

    Reported per kind: tasks graded, resolved, applied, resolve rate; per project the gold
    resolve rate; the seconds one `grade` call took (p50, p95: materialize, apply, run the
    suite in a sandbox); and every task whose result differs from the expectation.

How to run (from the repository root)
    .venv/bin/python bench/swe_grading.py                                  # the tiny set
    .venv/bin/python bench/swe_grading.py --tasks runs/swe_tasks/tasks.jsonl --sample 150
    options: --jobs J (default 2) --seed S --slot-base B (sandbox slots B.., default 340)
    Writes bench/results/swe_grading[_<name>].json (name: --name, default from the task set).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import CpuWatch, percentile, table, write_result  # noqa: E402
from flywheel.envs.sandbox.workdirs import new_workdir  # noqa: E402
from flywheel.envs.swe import TINY_TASKS, SweTask, grade, load_tasks, materialize  # noqa: E402
from flywheel.envs.swe.gitstore import working_diff  # noqa: E402
from flywheel.envs.swe.mutate import find_sites, mutate  # noqa: E402
from flywheel.envs.swe.testenv import default_backend  # noqa: E402

UNRELATED_LINES = 20
"""An unrelated change is this many lines or more away from the bug (nearer ones can compensate
for it: a flipped condition next to the bug's can make the tests pass again)."""
KINDS = {"gold": 1.0, "empty": 0.0, "other_gold": 0.0, "unrelated": 0.0, "test_edit": 0.0}
CHEAT = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
         "    outcome = yield\n    outcome.get_result().outcome = \"passed\"\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=str(TINY_TASKS))
    p.add_argument("--sample", type=int, help="grade a seeded sample of this many tasks (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--slot-base", type=int, default=340)
    p.add_argument("--name", help="result name suffix (default: tiny, or the task set's folder name)")
    return p.parse_args()


def wrong_diffs(task: SweTask, same_repo: list[SweTask], rng: random.Random) -> dict[str, str]:
    """The four wrong candidates for `task` (a kind is left out when it cannot be made)."""
    diffs = {"empty": ""}
    others = [t for t in same_repo if t.instance_id != task.instance_id]
    if others:
        diffs["other_gold"] = rng.choice(others).patch
    repo = new_workdir(f"bench-{task.instance_id}")
    try:
        materialize(task, repo)
        bug_file, bug_line = task.extra.get("file"), task.extra.get("line")
        sites = [s for s in find_sites(repo, (bug_file,)) if abs(s.line - bug_line) > UNRELATED_LINES] if bug_file else []
        if sites:
            path = repo / bug_file
            path.write_text(mutate(path.read_text(), rng.choice(sites)))
            diffs["unrelated"] = working_diff(repo)
            subprocess.run(["git", "-C", str(repo), "reset", "-q", "--hard"], check=True)
        (repo / "conftest.py").write_text(CHEAT)
        test_file = repo / task.FAIL_TO_PASS[0].split("::")[0]
        test_file.write_text(test_file.read_text() + "\n# edited by the benchmark\n")
        diffs["test_edit"] = working_diff(repo)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    return diffs


def main() -> None:
    args = parse_args()
    tasks = load_tasks(args.tasks)
    rng = random.Random(args.seed)
    chosen = sorted(rng.sample(tasks, args.sample), key=lambda t: t.instance_id) if args.sample else tasks
    by_repo = defaultdict(list)
    for t in tasks:
        by_repo[t.repo].append(t)
    backend = default_backend()
    free = list(range(args.slot_base, args.slot_base + args.jobs))

    def one(task: SweTask) -> list[dict]:
        diffs = {"gold": task.patch, **wrong_diffs(task, by_repo[task.repo], random.Random(f"{args.seed}:{task.instance_id}"))}
        slot = free.pop()
        rows = []
        try:
            for kind, diff in diffs.items():
                started = time.monotonic()
                g = grade(task, diff, backend, slot)
                rows.append({"task": task.instance_id, "repo": task.repo, "kind": kind, "reward": g.reward,
                             "applied": g.details["applied"], "reason": g.details["reason"][:300],
                             "seconds": time.monotonic() - started})
        finally:
            free.append(slot)
        print(f"{task.instance_id}: " + " ".join(f"{r['kind']}={r['reward']:g}" for r in rows), flush=True)
        return rows

    watch = CpuWatch().start()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = [r for rs in pool.map(one, chosen) for r in rs]
    cpu = watch.stop()

    kinds = {}
    for kind, expected in KINDS.items():
        mine = [r for r in rows if r["kind"] == kind]
        secs = [r["seconds"] for r in mine]
        kinds[kind] = {"expected_reward": expected, "graded": len(mine), "resolved": sum(r["reward"] == 1.0 for r in mine),
                       "applied": sum(r["applied"] for r in mine),
                       "resolve_rate": sum(r["reward"] for r in mine) / len(mine) if mine else None,
                       "grade_s_p50": percentile(secs, 50), "grade_s_p95": percentile(secs, 95)}
    gold_by_repo = {}
    for repo in sorted({r["repo"] for r in rows}):
        gold = [r for r in rows if r["repo"] == repo and r["kind"] == "gold"]
        gold_by_repo[repo] = {"graded": len(gold), "resolved": sum(r["reward"] == 1.0 for r in gold)}
    unexpected = [r for r in rows if r["reward"] != KINDS[r["kind"]]]
    print(table(["kind", "expected", "graded", "resolved", "applied", "rate", "grade s p50", "p95"],
                [[k, v["expected_reward"], v["graded"], v["resolved"], v["applied"], v["resolve_rate"],
                  v["grade_s_p50"], v["grade_s_p95"]] for k, v in kinds.items()]))
    print(f"unexpected results: {len(unexpected)}")
    name = args.name or ("tiny" if Path(args.tasks).resolve() == TINY_TASKS else Path(args.tasks).resolve().parent.name)
    path = write_result(f"swe_grading_{name}", {
        "args": vars(args), "tasks_in_set": len(tasks), "tasks_graded": len(chosen), "kinds": kinds,
        "gold_by_repo": gold_by_repo, "unexpected": unexpected, "cpu": cpu,
        "ok": not unexpected and kinds["gold"]["graded"] == len(chosen)})
    print(f"wrote {path}")
    sys.exit(1 if unexpected else 0)


if __name__ == "__main__":
    main()
