"""`flywheel swe`: SWE task sets: build one, validate one, run a command in a task's sandbox.

    flywheel swe build --out DIR [--n 300] [--seed 0] [--projects tinydb,parse] [--jobs 2] [--bundle]
    flywheel swe validate DIR/tasks.jsonl [--jobs 2] [--instances ID,ID]
    flywheel swe exec [--timeout S] DIR/tasks.jsonl INSTANCE_ID -- COMMAND...
    flywheel swe demos DIR/tasks.jsonl --out DEMOS.jsonl [--held-out 0.1] [--seed 0]

`build` writes DIR/tasks.jsonl, DIR/repos/ and DIR/build.json (flywheel/envs/swe/build.py). `validate`
prints one line per task and a summary, and exits 1 if any task is invalid. `exec` runs COMMAND
(one word: a shell line, as in `-- "pytest -q && echo ok"`; several: argv, each word kept as
given, as `docker exec` keeps it) in a fresh sandbox at the task's base commit with the
task's test environment, prints its output, and exits with its status (124 on timeout).
`demos` writes gold demonstrations (flywheel/envs/swe/demos.py) of the easy tasks outside a seeded
held-out share, one JSON object per line (`instance_id`, `messages`), for `flywheel sft`;
the held-out instance ids go to DEMOS.heldout.txt.
`--slot-base` moves the sandbox slots (uids 10000 + slot) away from others' on this machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from flywheel.envs.swe.gitstore import GitError
from flywheel.envs.swe.projects import PROJECTS


def _build(args: argparse.Namespace) -> int:
    from flywheel.envs.swe.build import build
    from flywheel.envs.swe.testenv import default_backend

    projects = args.projects.split(",") if args.projects else list(PROJECTS)
    summary = build(args.out, args.n, args.seed, projects, default_backend(), jobs=args.jobs,
                    slot_base=args.slot_base, bundle=args.bundle, log=lambda s: print(s, flush=True))
    print(json.dumps({k: summary[k] for k in ("tasks", "difficulty", "seconds")}))
    return 0 if summary["tasks"] else 1


def _validate(args: argparse.Namespace) -> int:
    from flywheel.envs.swe.tasks import load_tasks
    from flywheel.envs.swe.testenv import default_backend
    from flywheel.envs.swe.validate import validate

    tasks = load_tasks(args.tasks)
    if args.instances:
        wanted = set(args.instances.split(","))
        tasks = [t for t in tasks if t.instance_id in wanted]
    verdicts = validate(tasks, default_backend(), jobs=args.jobs, slot_base=args.slot_base,
                        log=lambda s: print(s, flush=True))
    return 0 if verdicts and all(v.ok for v in verdicts) else 1


def _exec(args: argparse.Namespace) -> int:
    from flywheel.envs.swe.execute import execute
    from flywheel.envs.swe.tasks import find_task, load_tasks

    if not args.command:
        print("exec: no command given (put it after --)", file=sys.stderr)
        return 2
    task = find_task(load_tasks(args.tasks), args.instance_id)
    # Several words are argv, each kept as it came (quoted for the sandbox's shell), as `docker
    # exec` and `kubectl exec` keep it; a single word is a shell line (`-- "make test && echo ok"`).
    command = args.command[0] if len(args.command) == 1 else shlex.join(args.command)
    result = execute(task, command, timeout_s=args.timeout, slot=args.slot_base)
    sys.stdout.write(result["output"])
    if result["exception_info"]:
        print(result["exception_info"], file=sys.stderr)
    return result["returncode"]


def _demos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flywheel.envs.swe.demos import demonstration, split
    from flywheel.envs.swe.env import SweEnv

    env = SweEnv(args.tasks, difficulty=["easy"], slot_base=args.slot_base)
    train, held_out = split(list(env.tasks.values()), args.held_out, args.seed)
    out = Path(args.out)
    written = 0
    with out.open("w") as f:
        for task in train:
            messages = demonstration(env, task)
            if messages is not None:
                f.write(json.dumps({"instance_id": task.instance_id, "messages": messages}) + "\n")
                written += 1
    out.with_suffix(".heldout.txt").write_text("".join(t.instance_id + "\n" for t in held_out))
    print(json.dumps({"demonstrations": written, "train_tasks": len(train), "held_out": len(held_out)}))
    return 0 if written else 1


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = __doc__.split("\n\n")[0].split(": ", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    sub = parser.add_subparsers(dest="swe_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="synthesize tasks from the pinned projects")
    b.add_argument("--out", required=True)
    b.add_argument("--n", type=int, default=300, help="tasks wanted in all (default 300)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--projects", help=f"comma-separated, default all: {','.join(PROJECTS)}")
    b.add_argument("--bundle", action="store_true", help="ship repos as repos/<project>.bundle files")
    v = sub.add_parser("validate", help="prove every task in its sandbox")
    v.add_argument("tasks")
    v.add_argument("--instances", help="comma-separated instance ids (default all)")
    e = sub.add_parser("exec", help="run one command in a fresh sandbox of a task (the command after --)")
    e.add_argument("--timeout", type=float, help="seconds (default: the task's timeout_s)")
    e.add_argument("tasks")
    e.add_argument("instance_id")
    e.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    d = sub.add_parser("demos", help="gold demonstrations of the easy tasks, for a supervised warm start")
    d.add_argument("tasks")
    d.add_argument("--out", required=True)
    d.add_argument("--held-out", type=float, default=0.1, help="share of the easy tasks set aside (default 0.1)")
    d.add_argument("--seed", type=int, default=0)
    for s in (b, v):
        s.add_argument("--jobs", type=int, default=2, help="suites run at once (default 2)")
    for s in (b, v, e, d):
        s.add_argument("--slot-base", type=int, default=0, help="first sandbox slot (default 0)")
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    if args.swe_command == "exec":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return {"build": _build, "validate": _validate, "exec": _exec, "demos": _demos}[args.swe_command](args)
    except (KeyError, OSError, ValueError, GitError) as e:  # a missing task, file, repository or commit
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
