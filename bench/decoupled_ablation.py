"""Evidence 3, "the decoupled loss is what makes staleness safe": final reward for
η ∈ {0, 1, 4, 8} × decoupled PPO on/off on the same workload.

Workload: configs/digits_tail.yaml (see bench/async_vs_sync.py), `train.max_steps`
steps. *Decoupled on*: AReaL's objective (π_prox recomputed, behaviour weight capped).
*Off*: standard PPO against the behaviour policy (`actor.use_decoupled_loss=false`): the ratio
is taken to the stale policy that sampled each token. Reported per cell: the final reward
(mean batch reward of the last 10 steps), its mean over `--seeds`, the maximum staleness seen,
samples dropped as too stale, and the run's wall time. AReaL reports naive PPO degrading badly
at η = 4. Writes bench/results/decoupled_ablation.json and docs/img/decoupled_ablation.png.

    .venv/bin/python bench/decoupled_ablation.py                   # 8 runs, ~15 min
    .venv/bin/python bench/decoupled_ablation.py --etas 0,4 --seeds 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import fmean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, machine, quiet_logs, table, wait_quiet, write_result  # noqa: E402
from bench.lib.train_runs import train_run  # noqa: E402
from flywheel.train.plot import plot_runs  # noqa: E402

CONFIG = "configs/digits_tail.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etas", default="0,1,4,8")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed to every flywheel train")
    args = parser.parse_args()
    quiet_logs()
    cells: dict[tuple[int, bool], list] = {}
    for seed in range(args.seeds):
        for eta in (int(e) for e in args.etas.split(",")):
            for decoupled in (True, False):
                wait_quiet()
                label = f"η={eta} {'decoupled' if decoupled else 'standard'} seed {seed}"
                run_dir = ROOT / "runs" / "bench_decoupled_ablation" / label.replace(" ", "-").replace("=", "")
                run = train_run(label, CONFIG, run_dir, [f"seed={seed}", f"rollout.max_head_offpolicyness={eta}",
                                                          f"actor.use_decoupled_loss={str(decoupled).lower()}", *args.overrides])
                cells.setdefault((eta, decoupled), []).append(run)
                print(f"{label}: final reward {run.final_reward():.3f}, {run.wall_s:.0f} s, "
                      f"staleness max {run.summary['staleness_max']}", flush=True)
    rows = [[f"η={eta}", "decoupled" if decoupled else "standard PPO", fmean(r.final_reward() for r in runs),
             " / ".join(f"{r.final_reward():.3f}" for r in runs), max(r.summary["staleness_max"] for r in runs),
             sum(r.summary["stale_dropped"] or 0 for r in runs), fmean(r.wall_s for r in runs)]
            for (eta, decoupled), runs in sorted(cells.items())]
    print(table(["η", "loss", "final reward (mean)", "per seed", "staleness max", "stale dropped", "wall s"], rows))
    curve = ROOT / "docs" / "img" / "decoupled_ablation.png"
    curve.parent.mkdir(parents=True, exist_ok=True)
    plot_runs({r.label: r.run_dir / "metrics.jsonl" for runs in cells.values() for r in runs[:1]}, curve,
              title="tiny on digits: η × decoupled loss")
    write_result("decoupled_ablation", {
        "args": vars(args), "machine": machine(None),
        "cells": {f"eta={eta},decoupled={decoupled}": {"final_reward": [r.final_reward() for r in runs],
                                                       "wall_s": [r.wall_s for r in runs],
                                                       "staleness_max": [r.summary["staleness_max"] for r in runs],
                                                       "stale_dropped": [r.summary["stale_dropped"] for r in runs]}
                  for (eta, decoupled), runs in cells.items()},
    })


if __name__ == "__main__":
    main()
