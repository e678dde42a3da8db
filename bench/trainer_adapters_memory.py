"""The trainer's memory with many users' adapters (`adapters.train_resident`): SmolLM2-135M,
rank 8 on every linear layer, N adapters (60) each taking one step in turn, then the first 10
again (back from disk when bounded), with every adapter kept in memory (`train_resident: null`)
and with at most R (8) kept: the process's resident memory after each step, and the step time of
a new adapter, of one still in memory, and of one back from disk.

    .venv/bin/python bench/trainer_adapters_memory.py [--adapters 60] [--resident 8]

Writes bench/results/trainer_adapters_memory.json. Each configuration runs in a process of its
own (so one's freed memory is not the other's baseline).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import machine, median, table, write_result  # noqa: E402


def one_configuration(n: int, resident: int | None, again: int) -> dict:
    """In this process: the trainer, N adapters a step each, then the first `again` once more."""
    import psutil
    import torch

    from bench.lib.workload import training_rows
    from flywheel.config import load_config
    from flywheel.models import load_model
    from flywheel.train.packing import micro_batches
    from flywheel.train.trainer import Trainer

    torch.set_num_threads(2)
    config = load_config(None, ["adapters.kind=lora", "adapters.rank=8", f"adapters.train_resident={resident or 'null'}"])
    model, tokenizer = load_model("smollm2-135m")
    process = psutil.Process()
    with tempfile.TemporaryDirectory() as spill:
        trainer = Trainer(model, config.actor, config.train, config.adapters)
        if resident:
            trainer.adapters.keep_on_disk(Path(spill) / "adapters")
        rows = training_rows(1, tokenizer.vocab_size, seed=0)
        batch = micro_batches(rows, 4096, tokenizer.pad_token_id or 0)
        rss, times = [], {"new": [], "in memory": [], "from disk": []}
        order = [f"u{i}" for i in range(n)] + [f"u{i}" for i in range(again)]
        for name in order:
            kind = "new" if name not in trainer.adapters else "from disk" if name in trainer.adapters.spilled else "in memory"
            trainer.adapters.ensure(name)
            for b in batch:
                b.adapter = name
            started = time.perf_counter()
            trainer.step([batch], version={name: 0})
            times[kind].append(time.perf_counter() - started)
            rss.append(process.memory_info().rss / 2**20)
        return {"resident": resident, "adapters": n, "rss_mb": [round(r) for r in rss], "peak_rss_mb": round(max(rss)),
                "in_memory_at_end": len(trainer.adapters.keys),
                "step_s": {k: round(median(v), 3) if v else None for k, v in times.items()},
                "steps": {k: len(v) for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=60)
    p.add_argument("--resident", type=int, default=8)
    p.add_argument("--again", type=int, default=10)
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration, print its JSON
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one_configuration(args.adapters, int(args.one) or None, args.again)))
        return
    runs = []
    for resident in (0, args.resident):  # 0: unbounded
        out = subprocess.run([sys.executable, __file__, "--one", str(resident), "--adapters", str(args.adapters),
                              "--again", str(args.again)], capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print(table(["train_resident", "peak RSS MB", "RSS after N MB", "in memory", "new s", "in memory s", "from disk s"],
                [[r["resident"] or "all", r["peak_rss_mb"], r["rss_mb"][args.adapters - 1], r["in_memory_at_end"],
                  r["step_s"]["new"], r["step_s"]["in memory"], r["step_s"]["from disk"]] for r in runs]))
    print("wrote", write_result("trainer_adapters_memory", {"machine": machine(2), "args": vars(args), "runs": runs}))


if __name__ == "__main__":
    main()
