"""Running `flywheel train` from a benchmark: one run per call, in its own run_dir, and what
it measured (summary, metrics lines, the reward at the end)."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from bench.lib.common import ROOT, CpuWatch
from flywheel.cli import command


@dataclass
class Run:
    label: str
    run_dir: Path
    summary: dict
    metrics: list[dict]
    cpu: dict

    @property
    def wall_s(self) -> float:
        """From the train loop's start to its last step: every rollout and step of the run,
        Ray and bus start-up excluded (the same for every run)."""
        return self.metrics[-1]["elapsed_s"]

    def final_reward(self, last: int = 10) -> float:
        return fmean(m["reward_mean"] for m in self.metrics[-last:])


def train_run(label: str, config: str, run_dir: Path, overrides: list[str], timeout_s: float = 3600) -> Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    watch = CpuWatch().start()
    done = subprocess.run([*command("train"), "--config", config, "--refresh-s", "5", f"run_dir={run_dir}",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    cpu = watch.stop()
    if done.returncode != 0:
        raise RuntimeError(f"{label}: flywheel train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Run(label, run_dir, json.loads((run_dir / "summary.json").read_text()), metrics, cpu)
