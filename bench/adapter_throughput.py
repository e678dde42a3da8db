"""Decoding with many LoRA adapters in one batch: the embedded engine against itself base-only,
and against vLLM's CPU build with the same adapters, in one run.

What it measures
    R rows (32) of seeded chat prompts (`bench/lib/workload.py`), each asking for exactly T tokens
    (48, `ignore_eos`, temperature 1), all submitted at once, rows spread evenly over 1, 8 or 32
    distinct random PEFT adapters (`bench/adapter_common.py`: all-linear, nonzero B) of rank 8,
    then of rank 32, or over none (base-only). Per engine and rank the configurations run
    interleaved (base, 1, 8, 32, base, 1, ...) `--repeats` times on one engine with all the
    adapters resident (`max_loras` 32, warmed once untimed), so each ratio's two sides share
    the machine's state. Reported: tok/s (medians), adapter/base (target >= 0.8x for the
    embedded engine) and embedded/vLLM (target >= 1x).

    - embedded: `flywheel.serve.engine.Engine` in this process (its own decoder, float32,
      `max_batch_size` R, `max_loras` 32), adapters read from their directories on first use;
    - vLLM: a server as Flywheel starts it with `adapters.kind: lora` (`--enable-lora
      --max-loras 32 --max-lora-rank <rank>`, `vllm_server.lora_flags`), one per rank, driven
      by Flywheel's client (`VLLMEngineClient`, adapters loaded with `load_adapter`); the
      embedded engine is stopped while vLLM runs and the other way round.

    Long outputs, adapters off: N (64) prompts with lengths drawn from {8, 16, 32, 64, 128, 256}
    (weights 32:16:8:4:2:1, `mixed_requests`), submitted at once, 32 decoding at a time, on both
    engines (vLLM without `--enable-lora`), alternating `--repeats` times; useful tok/s.

    On a GPU (`--device cuda --engines embedded,eager --no-long`, with `--dtype` and, for a model
    directory holding only a config and tokenizer, `--random-weights`) the embedded engine alone,
    its decode steps replayed from CUDA graphs (`embedded`, the default) and eager (`eager`,
    `serve.cuda_graphs: false`), each against itself base-only.

    With `--profile` (and whenever the embedded engine misses 0.8x on the CPU), the adapter path
    (`flywheel.models.lora_batch.Rows.add`) is profiled alone with torch's profiler on one
    decode step's worth of products (every adapted layer, 32 rows over 1, 8, 32 adapters),
    against the base products of the same layers.

How to run (from the repository root)
    .venv/bin/python bench/adapter_throughput.py                    # SmolLM2-135M, float32
    options: --model M --ranks 8,32 --adapters 1,8,32 --rows R --tokens T --repeats K
             --long-requests N --engines embedded,vllm --profile --no-long
             --device cuda --dtype bfloat16 --random-weights --name NAME
    python3 bench/adapter_throughput.py --model DIR --random-weights --device cuda --engines embedded,eager --no-long

    Writes bench/results/adapter_throughput_<model>[_<device>_<dtype>].json (or `--name`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.adapter_common import (
    embedded_engine,
    spread,
    start_vllm,
    timed_batch,
    write_adapters,
)
from bench.adapter_profile import profile_adapter_path
from bench.lib.common import (
    bench_model,
    machine,
    median,
    quiet_logs,
    table,
    write_result,
)
from bench.lib.workload import (
    TRAINING_OUTPUT_LENGTHS,
    TRAINING_OUTPUT_WEIGHTS,
    mixed_requests,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ranks", default="8,32")
    p.add_argument("--adapters", default="1,8,32")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--long-requests", type=int, default=64)
    p.add_argument("--engines", default="embedded,vllm")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-long", action="store_true")
    p.add_argument("--device", default="cpu", help="the embedded engine's device")
    p.add_argument("--dtype", default="float32", help="the embedded engine's weights, adapters and KV cache")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights of the model's shape")
    p.add_argument("--name", help="the result file's name (default from the model, device and dtype)")
    args = p.parse_args()
    args.name = args.name or "_".join(["adapter_throughput", Path(args.model).name]
                                      + ([args.device, args.dtype] if args.device != "cpu" else []))
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.adapters = [int(n) for n in args.adapters.split(",")]
    args.engines = args.engines.split(",")
    return args


EMBEDDED = ("embedded", "eager")
"""The embedded engine's kinds: its steps replayed from CUDA graphs where it runs on CUDA, and eager."""


class Side:
    """One engine kind's engine for one rank: started, warmed, measured, stopped."""

    def __init__(self, kind: str, args, workdir: Path, rank: int | None, names: dict[str, Path]):
        self.kind, self.args, self.workdir, self.rank, self.names = kind, args, workdir, rank, names
        self.server = None

    async def __aenter__(self):
        slots = max(self.args.adapters) if self.rank else 0
        if self.kind in EMBEDDED:
            root = next(iter(self.names.values())).parent if self.names else None
            self.engine = await asyncio.to_thread(embedded_engine, self.args.model, self.args.rows, slots, root,
                                                  self.args.dtype, self.args.device, self.args.random_weights,
                                                  self.kind == "embedded")
            return self
        from flywheel.serve.backends.vllm import VLLMEngineClient

        if self.rank:
            self.server = await asyncio.to_thread(start_vllm, self.args.model, self.workdir / f"vllm-r{self.rank}",
                                                  self.args.rows, slots, self.rank)
        else:  # adapters off: the server as Flywheel starts it without LoRA
            from flywheel.serve.backends.vllm_server import VLLMServer

            self.server = VLLMServer(self.args.model, "base", self.workdir / "vllm-base", max_num_seqs=self.args.rows)
            await asyncio.to_thread(self.server.start)
        self.engine = await VLLMEngineClient(self.server.url).connect()
        for name, path in self.names.items():
            await self.engine.load_adapter(name, str(path), 1)
        return self

    async def __aexit__(self, *exc):
        if self.kind in EMBEDDED:
            self.engine.stop()
        else:
            await self.engine.close()
            await asyncio.to_thread(self.server.stop)


async def rank_phase(kind: str, rank: int, names: dict[str, Path], prompts, args, workdir: Path) -> dict:
    """Base-only and 1/8/32 adapters interleaved on one engine: {config: [runs]}."""
    configs = {"base": [None] * args.rows} | {f"{n} adapters": spread(list(names)[:n], args.rows) for n in args.adapters}
    runs: dict[str, list] = {config: [] for config in configs}
    async with Side(kind, args, workdir, rank, names) as side:
        for rows in configs.values():  # warm-up: every adapter read into its slot, untimed
            await timed_batch(side.engine, prompts, rows, [4] * args.rows, quiet=False)
        for repeat in range(args.repeats):
            for config, rows in configs.items():
                run = await timed_batch(side.engine, prompts, rows, [args.tokens] * args.rows, seed=repeat)
                runs[config].append(run)
                print(f"  {kind} r{rank} {config}: {run['tok_s']} tok/s (others {run['foreign_cores']} cores)", flush=True)
    return runs


async def long_phase(args, workdir: Path, tokenizer) -> dict:
    """Heavy-tailed long outputs, adapters off, the engines alternating: {engine: [runs]}."""
    requests = mixed_requests(tokenizer, args.long_requests, TRAINING_OUTPUT_LENGTHS, TRAINING_OUTPUT_WEIGHTS, seed=1)
    prompts, lengths = [r["prompt_ids"] for r in requests], [r["max_new_tokens"] for r in requests]
    runs: dict[str, list] = {kind: [] for kind in args.engines}
    for repeat in range(args.repeats):
        for kind in args.engines:
            async with Side(kind, args, workdir, None, {}) as side:
                await timed_batch(side.engine, prompts[:4], [None] * 4, [4] * 4, quiet=False)
                run = await timed_batch(side.engine, prompts, [None] * len(prompts), lengths, seed=repeat)
            runs[kind].append(run)
            print(f"  long outputs {kind}: {run['tok_s']} tok/s (others {run['foreign_cores']} cores)", flush=True)
    return runs


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


async def main() -> None:
    args = parse_args()
    quiet_logs()
    model, tokenizer = bench_model(args.model, random_weights=args.random_weights)  # the shapes and the prompts
    prompts = [r["prompt_ids"] for r in mixed_requests(tokenizer, args.rows, [args.tokens], [1], seed=0)]
    result: dict = {"machine": machine(None), "args": vars(args), "ranks": {}}
    if args.device != "cpu":
        import torch

        result["gpu"] = torch.cuda.get_device_name(args.device)
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="adapters-") as tmp:
        workdir = Path(tmp)
        for rank in args.ranks:
            names = write_adapters(workdir / f"r{rank}", model, [f"r{rank}-{i}" for i in range(max(args.adapters))], rank)
            per_engine = {kind: await rank_phase(kind, rank, names, prompts, args, workdir) for kind in args.engines}
            medians = {kind: {config: median([r["tok_s"] for r in runs]) for config, runs in configs.items()}
                       for kind, configs in per_engine.items()}
            result["ranks"][rank] = {"runs": per_engine, "median_tok_s": medians}
            for config in medians[args.engines[0]]:
                each = [value for kind in args.engines
                        for value in (medians[kind][config], ratio(medians[kind][config], medians[kind]["base"]))]
                emb, vll = medians.get("embedded", {}), medians.get("vllm", {})
                rows_out.append([rank, config, *each, ratio(emb.get(config), vll.get(config))])
        if not args.no_long:
            long_runs = await long_phase(args, workdir, tokenizer)
            long_medians = {kind: median([r["tok_s"] for r in runs]) for kind, runs in long_runs.items()}
            result["long_outputs"] = {"runs": long_runs, "median_tok_s": long_medians,
                                      "embedded_over_vllm": ratio(long_medians.get("embedded"), long_medians.get("vllm"))}
    result["table"] = rows_out
    at = 3 + 2 * args.engines.index("embedded") if "embedded" in args.engines else None  # its x base column
    missed = at is not None and any(r[at] is not None and r[at] < 0.8 for r in rows_out)
    if args.profile or (missed and args.device == "cpu"):
        result["profile"] = profile_adapter_path(model, args.ranks, args.adapters, args.rows)
    print(table(["rank", "rows over", *[h for kind in args.engines for h in (f"{kind} tok/s", "x base")], "embedded/vLLM"],
                rows_out))
    if "long_outputs" in result:
        print("long outputs, adapters off:", result["long_outputs"]["median_tok_s"], "embedded/vLLM",
              result["long_outputs"]["embedded_over_vllm"])
    print("wrote", write_result(args.name, result))


if __name__ == "__main__":
    asyncio.run(main())
