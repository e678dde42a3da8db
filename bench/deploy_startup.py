"""How long a deployment takes to come up: `configs/local.yaml` (`make run`'s, eight loops and
servers as Ray actors on this machine) entered with `Deployment`, timed until every loop has
answered its start, then stopped. Each run in a fresh process and run directory, on a Ray of its
own (`ray.init`, not timed). To compare two trees, run this from each, alternating.

How to run (from the repository root)
    .venv/bin/python bench/deploy_startup.py [--repeats 3]

Writes bench/results/deploy_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, START_COMMIT  # noqa: E402

PROBE = """
import json, sys, time, ray
from flywheel.config import load_config
from flywheel.deploy.deployment import Deployment
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
config = load_config("configs/local.yaml", [f"run_dir={sys.argv[1]}", "serve.port=0"])
started = time.monotonic()
with Deployment(config):
    up = time.monotonic() - started
    stopping = time.monotonic()
print(json.dumps({"up_s": up, "down_s": time.monotonic() - stopping}))
"""


def once() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "RAY_USAGE_STATS_ENABLED": "0"}
        done = subprocess.run([sys.executable, "-c", PROBE, run_dir], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(once())
        print(f"run {i + 1}: up in {runs[-1]['up_s']:.1f} s, down in {runs[-1]['down_s']:.1f} s", flush=True)
    result = {"commit": START_COMMIT, "runs": runs, "up_median_s": median(r["up_s"] for r in runs)}
    print(f"up: median {result['up_median_s']:.1f} s over {len(runs)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deploy_startup.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
