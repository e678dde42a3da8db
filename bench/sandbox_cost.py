"""Sandbox cost: what the bubblewrap sandbox adds per command and per SWE episode.

What it measures (each `--runs` times, median / p95 / mean / min in ms)
    per command
    - plain `true` and `bash -c true` with subprocess.run (no sandbox);
    - the bare `bwrap … true` command line the backend builds (subprocess.run), and the same
      through `Sandbox.execute("true")` (adds the output pipe, the status pipe and waiting for
      the PID namespace to be gone);
    - `python3 -c pass`, plain vs `Sandbox.execute`, the same interpreter (the one whose prefix
      the sandbox binds; interpreter start-up through the binds).
    per episode (the sandbox's share of an SWE episode's set-up and end)
    - copy a tinydb-sized repository with its .git (shutil.copytree, standing in for the SWE
      environment's `materialize`, which exports the task's commit with a few git commands and
      costs more), `backend.open` (chown
      to the slot's uid), the first command (`git status --porcelain`), and `close()` (sweep
      the slot's uid, remove the copy).

    The repository is `--repo PATH` if given, else a synthetic one shaped like tinydb 4.9.0's
    sdist (25 files in 3 folders, 151 kB) committed into git once, untimed. Each phase first
    waits (up to 90 s) for other processes to use under 0.25 cores and records how much CPU they
    used while it ran (the machine is shared).

How to run (from the repository root, as root: the backend needs it)
    .venv/bin/python bench/sandbox_cost.py             # 50 runs each
    options: --runs N --repo PATH --slot S
    Writes bench/results/sandbox_cost.json.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    CpuWatch,
    machine,
    percentile,
    table,
    wait_quiet,
    write_result,
)
from flywheel.envs.sandbox import SandboxSpec, make_backend  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--repo", type=Path, help="a repository folder to copy per episode (default: synthetic, tinydb-sized)")
    p.add_argument("--slot", type=int, default=900, help="sandbox slot (uid 10000+slot) used by the benchmark")
    return p.parse_args()


def synthetic_repo(root: Path) -> Path:
    """A git repository shaped like tinydb 4.9.0's sdist: 25 files in 3 folders, ~151 kB."""
    rng = random.Random(0)
    repo = root / "tinydb-like"
    layout = {"": ["LICENSE", "PKG-INFO", "README.rst", "pyproject.toml"],
              "tinydb": [f"mod{i}.py" for i in range(11)] + ["py.typed"],
              "tests": [f"test_{i}.py" for i in range(9)]}
    sizes = [rng.randint(1500, 10500) for _ in range(25)]
    k = 0
    for folder, names in layout.items():
        (repo / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            words = [rng.choice(["def", "return", "self", "query", "table", "assert", "x", "=", "(", ")"]) for _ in range(sizes[k] // 5)]
            (repo / folder / name).write_text(" ".join(words)[: sizes[k]] + "\n")
            k += 1
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.invalid", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run([*git, *cmd], cwd=repo, check=True)
    return repo


def timed(runs: int, fn: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def stats(ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2),
            "mean_ms": round(sum(ms) / len(ms), 2), "min_ms": round(min(ms), 2), "n": len(ms)}


def check(result: dict) -> None:
    if result["returncode"] != 0:
        raise RuntimeError(f"sandboxed command failed: {result}")


def per_command(backend, template: Path, scratch: Path, args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each command `--runs` times, plain and through the sandbox, in one sandbox opened on a
    copy of `template`. -> (stats per command, CPU other processes used per command)."""
    results: dict[str, dict] = {}
    noise: dict[str, dict] = {}
    workdir = scratch / "cmd" / "repo"
    shutil.copytree(template, workdir, symlinks=True)
    sandbox = backend.open(SandboxSpec(workdir=workdir), slot=args.slot)
    bare = backend.argv(sandbox.spec, sandbox.uid, sandbox.workdir, "true")
    python = f"{backend.python_prefixes[0]}/bin/python3"  # the interpreter the sandbox exposes, in both
    phases: dict[str, Callable[[], object]] = {
        "plain `true` (subprocess.run)": lambda: subprocess.run(["true"], check=True),
        "plain `bash -c true`": lambda: subprocess.run(["bash", "-c", "true"], check=True),
        "`bwrap … true` (subprocess.run)": lambda: subprocess.run(bare, check=True),
        "Sandbox.execute('true')": lambda: check(sandbox.execute("true")),
        "plain `python3 -c pass`": lambda: subprocess.run([python, "-c", "pass"], check=True),
        "Sandbox.execute('python3 -c pass')": lambda: check(sandbox.execute(f"{python} -c pass")),
    }
    for name, fn in phases.items():
        fn()  # warm the page cache
        noise_before = wait_quiet()
        watch = CpuWatch().start()
        results[name] = stats(timed(args.runs, fn))
        noise[name] = {**watch.stop(), "waited": noise_before}
    sandbox.close()
    return results, noise


def per_episode(backend, template: Path, scratch: Path, args: argparse.Namespace) -> tuple[dict[str, dict], dict]:
    """`--runs` episodes' set-up (copy `template`, open, first command) and close, each step
    timed. -> (stats per step, CPU other processes used meanwhile)."""
    copy_ms, open_ms, first_ms, setup_ms, close_ms = [], [], [], [], []
    noise_before = wait_quiet()
    watch = CpuWatch().start()
    for i in range(args.runs):
        workdir = scratch / f"episode-{i}" / "repo"
        t0 = time.perf_counter()
        shutil.copytree(template, workdir, symlinks=True)
        t1 = time.perf_counter()
        sandbox = backend.open(SandboxSpec(workdir=workdir), slot=args.slot)
        t2 = time.perf_counter()
        check(sandbox.execute("git status --porcelain"))
        t3 = time.perf_counter()
        sandbox.close()
        t4 = time.perf_counter()
        copy_ms.append((t1 - t0) * 1000)
        open_ms.append((t2 - t1) * 1000)
        first_ms.append((t3 - t2) * 1000)
        setup_ms.append((t3 - t0) * 1000)
        close_ms.append((t4 - t3) * 1000)
    noise = {**watch.stop(), "waited": noise_before}
    return {
        "episode: copy repo (copytree)": stats(copy_ms),
        "episode: backend.open (chown)": stats(open_ms),
        "episode: first command (git status)": stats(first_ms),
        "episode: setup total (copy+open+first)": stats(setup_ms),
        "episode: close (sweep uid, rm copy)": stats(close_ms),
    }, noise


def report(args: argparse.Namespace, backend, bwrap_version: str, repo: dict, results: dict[str, dict],
           noise: dict[str, dict]) -> None:
    """The table, the per-command overhead (Sandbox.execute('true') against plain bash -c true),
    and bench/results/sandbox_cost.json."""
    rows = [[name, r["median_ms"], r["p95_ms"], r["mean_ms"], r["min_ms"],
             noise.get(name, noise.get("episode", {})).get("foreign_cores")] for name, r in results.items()]
    print(f"\nbubblewrap sandbox cost ({bwrap_version}; repo: {repo['files']} files, {repo['bytes'] / 1000:.0f} kB; "
          f"{args.runs} runs each)\n")
    print(table(["what", "median ms", "p95 ms", "mean ms", "min ms", "other procs' cores"], rows))
    overhead = results["Sandbox.execute('true')"]["median_ms"] - results["plain `bash -c true`"]["median_ms"]
    print(f"\nper-command overhead (median, Sandbox.execute('true') - plain bash -c true): {overhead:.1f} ms")
    path = write_result("sandbox_cost", {
        "machine": machine(None), "bwrap": bwrap_version, "bwrap_path": backend.bwrap, "runs": args.runs,
        "repo": repo, "results": results, "per_command_overhead_median_ms": round(overhead, 2), "noise": noise})
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    backend = make_backend("bubblewrap")
    bwrap_version = subprocess.run([backend.bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix="sandbox-cost-"))
    try:
        template = args.repo.resolve() if args.repo else synthetic_repo(scratch / "template")
        repo = {"source": str(args.repo) if args.repo else "synthetic tinydb-sized (with .git)",
                "files": sum(1 for p in template.rglob("*") if p.is_file()),
                "bytes": sum(p.stat().st_size for p in template.rglob("*") if p.is_file())}
        results, noise = per_command(backend, template, scratch, args)
        episode_results, noise["episode"] = per_episode(backend, template, scratch, args)
        results.update(episode_results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, backend, bwrap_version, repo, results, noise)


if __name__ == "__main__":
    main()
