"""Synthesizing SWE tasks: seeded bug injection into real projects, kept when tests catch it.

For each pinned project (`projects.py`): download its sdist (cached), run its test suite twice
in the sandbox (tests whose outcome differs are flaky and never used; `stable` = passed both
times), list every mutation site of its non-test code (`mutate.py`) and draw sites in a seeded
order without replacement. Each drawn site gives one mutant (a duplicate tree is skipped),
whose whole suite runs in a fresh sandbox with a timeout of max(60 s, 5 x the baseline). Kept:

    valid      some stable tests fail (FAIL_TO_PASS), some still pass (PASS_TO_PASS = the rest
               of the stable tests that pass; a stable test the mutant skips is in neither)
Dropped:
    survived   no stable test fails          timeout   the suite ran past its limit
    broken     a stable test did not run (an import or collection error)
    all_fail   no stable test passes any more

Results are taken in site order, so the same seed gives the same tasks whatever `jobs` is.
Each project's quota is an equal share of `n`; what a project cannot fill (it ran out of sites)
goes to the others. The output folder gets `tasks.jsonl`, `repos/<project>/` (bare
repositories, or `repos/<project>.bundle` files with `bundle=True`; see `gitstore.py`) and
`build.json` (per-project counts and timings).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flywheel.envs.sandbox.base import SandboxBackend
from flywheel.envs.sandbox.workdirs import new_workdir
from flywheel.envs.slots import SlotPool
from flywheel.envs.swe import gitstore, sdist
from flywheel.envs.swe.mutate import Site, find_sites, mutate, sample_sites
from flywheel.envs.swe.projects import PROJECTS, Project
from flywheel.envs.swe.statement import (
    difficulty,
    enclosing_function,
    problem_statement,
)
from flywheel.envs.swe.tasks import SweTask, save_tasks
from flywheel.envs.swe.testenv import TestRun, opened, run_tests

MIN_TIMEOUT_S = 60.0
TIMEOUT_FACTOR = 5.0


class ProjectBuild:
    """One project's mutants; `run(quota)` can be called again to draw further sites."""

    def __init__(self, project: Project, out: Path, seed: int, backend: SandboxBackend, slots: SlotPool):
        self.project, self.seed, self.backend, self.slots = project, seed, backend, slots
        started = time.monotonic()
        self.work = new_workdir(f"build-{project.name}")
        self.work.mkdir(parents=True)
        self.pristine = sdist.unpack(sdist.fetch(project), self.work / "pristine")
        self.store = gitstore.init_store(out / "repos" / project.name)
        self.tree = gitstore.write_tree(self.store, self.pristine, self.work / "index")
        all_sites = find_sites(self.pristine, project.sources)
        self.site_ids = {site: i for i, site in enumerate(all_sites)}
        self.sites = sample_sites(all_sites, f"{seed}:{project.name}")
        self.drawn = 0
        self.seen_trees: set[str] = set()
        self.pending: list[tuple] = []
        """Valid mutants found beyond the last quota, handed out first next time."""
        self.counts: Counter[str] = Counter()
        self.stable, self.flaky, self.baseline_s = self._baseline()
        self.timeout_s = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * self.baseline_s)
        self.seconds = time.monotonic() - started
        """Time spent on this project: setup, baseline and every `run`."""

    @property
    def exhausted(self) -> bool:
        return self.drawn >= len(self.sites) and not self.pending

    def _suite(self, files: dict[str, str], timeout_s: float) -> TestRun:
        """The whole suite on a copy of the pristine tree with `files` (path -> text) replaced."""
        with self.slots.held() as slot:
            workdir = new_workdir(f"mutant-{self.project.name}")
            shutil.copytree(self.pristine, workdir, symlinks=True)
            for path, text in files.items():
                (workdir / path).write_bytes(text.encode("utf-8"))
            with opened(self.backend, workdir, self.project.pythonpath, timeout_s, slot) as sandbox:
                return run_tests(sandbox, self.project.test_cmd, timeout_s)

    def _baseline(self) -> tuple[list[str], list[str], float]:
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda _: self._suite({}, 600.0), range(2)))
        for run in runs:
            if run.timed_out or not run.tests:
                raise RuntimeError(f"{self.project.requirement}: the baseline suite did not run "
                                   f"(rc {run.returncode}):\n{run.output[-3000:]}")
        a, b = runs[0].tests, runs[1].tests
        flaky = sorted(t for t in set(a) | set(b) if a.get(t, {}).get("outcome") != b.get(t, {}).get("outcome"))
        stable = [t for t in a if runs[0].passed(t) and runs[1].passed(t)]
        return stable, flaky, max(run.duration_s for run in runs)

    def _classify(self, run: TestRun) -> tuple[str, list[str], list[str]]:
        if run.timed_out:
            return "timeout", [], []
        if not run.tests or any(t not in run.tests for t in self.stable):
            return "broken", [], []
        f2p = [t for t in self.stable if run.tests[t]["outcome"] in ("failed", "error")]
        p2p = [t for t in self.stable if run.tests[t]["outcome"] == "passed"]
        status = "survived" if not f2p else "all_fail" if not p2p else "valid"
        return status, f2p, p2p

    def _task(self, site: Site, tree: str, run: TestRun, f2p: list[str], p2p: list[str]) -> SweTask:
        iid = f"{self.project.name}__mut-{self.site_ids[site]:04d}"
        base = gitstore.commit_tree(self.store, tree, f"refs/tasks/{iid}")
        tier = difficulty(len(f2p))
        failures = {t: run.tests[t]["message"] for t in f2p}
        return SweTask(
            instance_id=iid, repo=self.project.name, base_commit=base, patch=gitstore.diff(self.store, tree, self.tree),
            FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p,
            problem_statement=problem_statement(failures, self.project.test_cmd, tier, site.file, enclosing_function(
                (self.pristine / site.file).read_text(), site.line)),
            version=self.project.version, difficulty=tier, test_cmd=self.project.test_cmd,
            pythonpath=self.project.pythonpath, timeout_s=self.timeout_s,
            extra={"mutation": site.kind, "file": site.file, "line": site.line, "seed": self.seed,
                   "sdist_sha256": self.project.sdist_sha256})

    def run(self, quota: int, jobs: int) -> list[SweTask]:
        """Up to `quota` more valid tasks (fewer when the sites run out)."""
        started = time.monotonic()
        found = self.pending
        with ThreadPoolExecutor(jobs) as pool:
            while len(found) < quota and self.drawn < len(self.sites):
                batch = self.sites[self.drawn:self.drawn + max(jobs, quota - len(found))]
                self.drawn += len(batch)
                mutants = []
                for site in batch:
                    code = mutate((self.pristine / site.file).read_bytes().decode("utf-8"), site)
                    tree = gitstore.tree_with(self.store, self.tree, site.file, code.encode("utf-8"))
                    if tree in self.seen_trees:
                        self.counts["duplicate"] += 1
                        continue
                    self.seen_trees.add(tree)
                    mutants.append((site, tree, code))
                runs = pool.map(lambda m: self._suite({m[0].file: m[2]}, self.timeout_s), mutants)
                for (site, tree, _), run in zip(mutants, runs):
                    status, f2p, p2p = self._classify(run)
                    self.counts[status] += 1
                    if status == "valid":
                        found.append((site, tree, run, f2p, p2p))
        self.pending = found[quota:]
        tasks = [self._task(*valid) for valid in found[:quota]]
        self.seconds += time.monotonic() - started
        return tasks

    def summary(self, kept: int) -> dict[str, Any]:
        return {"version": self.project.version, "sites": len(self.sites), "attempted": self.drawn,
                "kept": kept, "outcomes": dict(sorted(self.counts.items())), "stable_tests": len(self.stable),
                "flaky_tests": self.flaky, "baseline_s": round(self.baseline_s, 2), "timeout_s": self.timeout_s,
                "seconds": round(self.seconds, 1)}

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _shares(n: int, k: int) -> list[int]:
    return [n // k + (i < n % k) for i in range(k)]


def build(out: Path, n: int, seed: int, projects: list[str], backend: SandboxBackend, jobs: int = 2,
          slot_base: int = 0, bundle: bool = False, log=print) -> dict[str, Any]:
    """Synthesize up to `n` tasks from `projects` into `out` (new or empty); the build summary."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    unknown = [p for p in projects if p not in PROJECTS]
    if unknown:
        raise ValueError(f"unknown projects {unknown}; choose from {', '.join(PROJECTS)}")
    started = time.monotonic()
    slots = SlotPool(range(slot_base, slot_base + jobs))
    builds: list[ProjectBuild] = []
    tasks: dict[str, list[SweTask]] = {}
    try:
        for name in projects:
            builds.append(ProjectBuild(PROJECTS[name], out, seed, backend, slots))
            log(f"{name}: {len(builds[-1].sites)} sites, {len(builds[-1].stable)} stable tests, "
                f"baseline {builds[-1].baseline_s:.1f} s")
        quotas = dict(zip(projects, _shares(n, len(projects))))
        while quotas:
            for b in builds:
                if quotas.get(b.project.name):
                    got = b.run(quotas[b.project.name], jobs)
                    tasks.setdefault(b.project.name, []).extend(got)
                    log(f"{b.project.name}: {len(tasks[b.project.name])} tasks, {dict(b.counts)}")
            deficit = n - sum(map(len, tasks.values()))
            open_builds = [b.project.name for b in builds if not b.exhausted]
            quotas = dict(zip(open_builds, _shares(deficit, len(open_builds)))) if deficit > 0 and open_builds else {}
        summary = {"n": n, "seed": seed, "jobs": jobs, "projects": {}}
        for b in builds:
            summary["projects"][b.project.name] = b.summary(len(tasks.get(b.project.name, [])))
    finally:
        for b in builds:
            b.close()
    every = sorted((t for ts in tasks.values() for t in ts), key=lambda t: t.instance_id)
    save_tasks(every, out / "tasks.jsonl")
    for b in builds:
        gitstore.pack(b.store)
        if bundle:
            gitstore.bundle(b.store, out / "repos" / f"{b.project.name}.bundle")
            shutil.rmtree(b.store)
    summary.update(tasks=len(every), difficulty=dict(Counter(t.difficulty for t in every)),
                   seconds=round(time.monotonic() - started, 1), python=sys.version.split()[0])
    (out / "build.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
