"""Where a decode step's time goes in the embedded engine's adapter path
(`flywheel.models.lora_batch.Rows.add`), measured alone (or a prefill's: `--tokens N` a row): one
decode step's worth of adapter products (every decoder layer's q/k/v, o, gate/up and down, grouped
as the engine's decoder fuses them) for R rows spread over 1, 8 or 32 adapters, against the base
products of the same layers and against their floor (`read_ms`: the time to read once, by a sum,
the `adapters_mb` of A and B the step's adapters hold, which any product over them must read),
then torch's profiler on the adapter products (the ops taking the most time, per step). On the
model's device: on a GPU the step times are synced wall times (the host's launches included) and
the profile also counts each op's kernels' GPU time. Used by
`bench/adapter_throughput.py` (`--profile`, or when the engine misses 0.8x); alone:

    .venv/bin/python bench/adapter_profile.py [--model smollm2-135m] [--ranks 8,32]
    python3 bench/adapter_profile.py --model DIR --random-weights --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.adapter_common import adapted_layers, spread
from bench.lib.common import bench_model, median

GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The products the engine's decoder fuses (their deltas added to one output, `Rows.add`)."""


def step_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Each decoder layer's fused groups of linear layers, in order."""
    modules = dict(model.named_modules())
    by_block: dict[str, dict[str, torch.nn.Linear]] = {}
    for name, _, _ in adapted_layers(model):
        by_block.setdefault(name.rsplit(".", 2)[0], {})[name.rsplit(".", 1)[1]] = modules[name]
    return [[layers[s] for s in group if s in layers] for layers in by_block.values()
            for group in GROUPS if any(s in layers for s in group)]


def _table(model: torch.nn.Module, rank: int, n_adapters: int):
    from flywheel.models.lora_adapter import LoraAdapter
    from flywheel.models.lora_batch import AdapterTable

    table = AdapterTable(model, n_adapters)
    generator = torch.Generator().manual_seed(rank)
    for slot in range(1, n_adapters + 1):
        layers = {name: (torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5,
                         torch.randn(fan_out, rank, generator=generator) * 0.02)
                  for name, fan_in, fan_out in adapted_layers(model)}
        table.write(slot, LoraAdapter(Path(f"slot{slot}"), layers))
    return table


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _step_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - started)
    return round(median(times) * 1000, 2)


@torch.inference_mode()
def profile_adapter_path(model: torch.nn.Module, ranks: list[int], counts: list[int], n_rows: int = 32,
                         tokens: int = 1) -> dict:
    """{"step_ms": rows of (rank, adapters, base ms, adapter ms), "top_ops": {rank/adapters: ops}};
    `tokens` a row: 1 a decode step, more a prefill's forward."""
    groups = step_groups(model)
    like = {"dtype": next(model.parameters()).dtype, "device": next(model.parameters()).device}
    inputs = [torch.randn(n_rows * tokens, group[0].in_features, **like) for group in groups]
    outputs = [torch.zeros(n_rows * tokens, sum(layer.out_features for layer in group), **like) for group in groups]

    def base() -> None:
        for x, out, group in zip(inputs, outputs, groups):
            torch.cat([torch.nn.functional.linear(x, layer.weight) for layer in group], 1, out=out)

    base_ms = _step_ms(base)
    rows_out, top = [], {}
    for rank in ranks:
        table = _table(model, rank, max(counts))
        for n in counts:
            rows = table.rows(spread(list(range(1, n + 1)), n_rows))

            def adapters(rows=rows) -> None:
                for x, out, group in zip(inputs, outputs, groups):
                    rows.add(out, x, group)

            used = [(stacks.a[1:n + 1], stacks.b[1:n + 1]) for stacks in table.low_rank.values()]

            def read(used=used) -> None:
                for a, b in used:
                    a.sum(), b.sum()

            floor_mb = sum(a.numel() + b.numel() for a, b in used) * like["dtype"].itemsize / 1e6
            rows_out.append({"rank": rank, "adapters": n, "base_products_ms": base_ms, "adapter_products_ms": _step_ms(adapters),
                             "adapters_mb": round(floor_mb), "read_ms": _step_ms(read)})
            if n == max(counts):
                top[f"r{rank}/{n}"] = _top_ops(adapters)
    return {"rows": n_rows, "tokens": tokens, "step_ms": rows_out, "top_ops": top}


def _top_ops(fn, steps: int = 3, limit: int = 10) -> list[dict]:
    """The ops with the most self CPU time in `fn`, per call of it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    gpu = torch.cuda.is_initialized()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        for _ in range(steps):
            fn()
        _sync()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:limit]
    return [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2), "calls_per_step": e.count // steps}
            | ({"gpu_ms_per_step": round(e.self_device_time_total / 1000 / steps, 3)} if gpu else {}) for e in events]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ranks", default="8,32")
    p.add_argument("--adapters", default="1,8,32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights of the model's shape")
    p.add_argument("--tokens", type=int, default=1, help="tokens a row: 1 a decode step, more a prefill's forward")
    args = p.parse_args()
    model, _ = bench_model(args.model, args.dtype, args.device, args.random_weights)
    result = profile_adapter_path(model, [int(r) for r in args.ranks.split(",")], [int(n) for n in args.adapters.split(",")],
                                  tokens=args.tokens)
    for row in result["step_ms"]:
        print(row)
    for key, ops in result["top_ops"].items():
        print(key)
        for op in ops:
            print("  ", op)


if __name__ == "__main__":
    main()
