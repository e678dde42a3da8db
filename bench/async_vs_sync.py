"""Evidence 2, "asynchronous beats synchronous": the same workload and the same number of
trained samples with η = 4 (asynchronous, decoupled PPO) against η = 0 (synchronous: the
rollout driver admits a batch only once the trainer has consumed the previous one).

Workload: configs/digits_tail.yaml (the `tiny` model on `digits`, heavy-tailed generation
lengths: Pareto tail, alpha 1, 8 to 512 tokens, generated to the end), `train.max_steps` steps
of `train.batch_size` samples each, `--seeds` seeds per setting, run one after another through
`flywheel train`. Reported per setting: wall-clock time from the train loop's start to its
last step, the final reward (mean batch reward of the last 10 steps) and staleness; and the
ratio of the mean times (target >= 2x; AReaL reports up to 2.77x) with the final rewards' spread
across seeds as the noise level. Writes bench/results/NAME.json and docs/img/NAME.png
(`--name`, default async_vs_sync).

    .venv/bin/python bench/async_vs_sync.py                      # 2 seeds x 2 settings, ~5 min
    .venv/bin/python bench/async_vs_sync.py --seeds 1 train.max_steps=20
    .venv/bin/python bench/async_vs_sync.py --name async_vs_sync_smollm2 model=smollm2-135m \
        train.batch_size=16 rollout.sampling.max_new_tokens=1024 train.max_steps=8 actor.optimizer.lr=0.00001   # ~17 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import fmean, pstdev

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, machine, quiet_logs, table, wait_quiet, write_result  # noqa: E402
from bench.lib.train_runs import train_run  # noqa: E402
from flywheel.train.plot import plot_runs  # noqa: E402

CONFIG = "configs/digits_tail.yaml"
SETTINGS = {"async (η=4)": ["rollout.max_head_offpolicyness=4"], "sync (η=0)": ["rollout.max_head_offpolicyness=0"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--name", default="async_vs_sync", help="writes bench/results/NAME.json and docs/img/NAME.png (NAME begins async_vs_sync: bench/README.md)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed to every flywheel train")
    args = parser.parse_args()
    quiet_logs()
    runs = {name: [] for name in SETTINGS}
    for seed in range(args.seeds):
        for name, settings in SETTINGS.items():  # alternate, so drifts in the machine hit both
            wait_quiet()
            run_dir = ROOT / "runs" / "bench_async_vs_sync" / f"{name.split()[0]}-seed{seed}"
            run = train_run(f"{name} seed {seed}", CONFIG, run_dir, [f"seed={seed}", *settings, *args.overrides])
            runs[name].append(run)
            print(f"{run.label}: {run.wall_s:.1f} s, final reward {run.final_reward():.3f}, "
                  f"staleness max {run.summary['staleness_max']}, foreign cores {run.cpu['foreign_cores']}", flush=True)

    rows, stats = [], {}
    for name, done in runs.items():
        walls, finals = [r.wall_s for r in done], [r.final_reward() for r in done]
        stats[name] = {"wall_s": walls, "final_reward": finals, "staleness_max": [r.summary["staleness_max"] for r in done],
                       "samples": [r.summary["samples"] for r in done], "stale_dropped": [r.summary["stale_dropped"] for r in done],
                       "foreign_cores": [r.cpu["foreign_cores"] for r in done]}
        rows.append([name, fmean(walls), fmean(finals), pstdev(finals) if len(finals) > 1 else None, max(stats[name]["staleness_max"])])
    speedup = fmean(stats["sync (η=0)"]["wall_s"]) / fmean(stats["async (η=4)"]["wall_s"])
    print(table(["setting", "wall s (mean)", "final reward (mean)", "final reward (sd)", "staleness max"], rows))
    print(f"sync / async wall-clock: {speedup:.2f}x (target >= 2x)")
    curve = ROOT / "docs" / "img" / f"{args.name}.png"
    curve.parent.mkdir(parents=True, exist_ok=True)
    model = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model=")), "tiny")
    plot_runs({r.label: r.run_dir / "metrics.jsonl" for done in runs.values() for r in done}, curve,
              title=f"{model} on digits, heavy-tailed lengths: η=4 vs η=0")
    write_result(args.name, {"args": vars(args), "machine": machine(None), "settings": SETTINGS, "runs": stats,
                                   "speedup": speedup})


if __name__ == "__main__":
    main()
