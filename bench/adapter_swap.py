"""The embedded engine's LoRA adapters under change: the stall a running stream sees when one
adapter's new version is loaded, and many adapters on disk behind a few slots.

What it measures (SmolLM2-135M float32 unless told, rank-8 all-linear random PEFT adapters,
`bench/adapter_common.py`)
    swap stall: C (16) streams of T (160) tokens at temperature 1, half on adapter `alice`, half
    on the base, in the engine's own event loop (`Engine.stream`); once every stream decodes
    (prefills over) and 0.3 s more, `alice`'s next
    version is loaded (`Engine.load_adapter`: read in a worker thread, written into its slot
    between two decode steps) K (4) times, 0.4 s apart, alternating two directories. Reported:
    the longest gap between two tokens of any stream while a load was under way (from its call
    to its return, and 0.1 s after), against the longest gap over the same stretch of a run
    with no load (target <= 50 ms more), and the load's own time. The two runs alternate
    `--repeats` times. `--engine vllm`: the same against vLLM's CPU build as Flywheel runs it
    (`adapters.kind: lora`, `bench/adapter_common.start_vllm`), through Flywheel's client
    (`VLLMEngineClient`: each version loaded under a name of its own, `/v1/load_lora_adapter`;
    the streams on SGLang's protocol, `/inference/v1/generate`); the swap stall only.

    scale: N (1,000) adapters on disk under the engine's adapter root (`serve.lora_root`), with
    `max_loras` 8 and then 32:
    - memory: the process's resident memory before any adapter and once every slot is full,
      and the slot table's bytes;
    - first-request latency (one token, idle engine) of a cold adapter (never read, its weights
      file dropped from the page cache with posix_fadvise, so read from disk), of the same
      adapter again (warm, resident) and of the base (medians of 8);
    - throughput while adapters churn: 32 workers for D (20) s each, every request 32 tokens,
      its adapter drawn uniformly from all N (nearly every request cold), from a hot set of
      `max_loras` adapters (all resident), or none (base); useful tok/s and the longest gap
      between two tokens of a stream (a cold adapter is read on the engine's thread when its
      request is admitted, `flywheel.serve.engine.adapters.Adapters.acquire`). Interleaved.

How to run (from the repository root)
    .venv/bin/python bench/adapter_swap.py
    options: --model M --streams C --tokens T --swaps K --repeats R --adapters N
             --max-loras 8,32 --duration D --no-scale --engine embedded|vllm

    Writes bench/results/adapter_swap_<model>.json (`--engine vllm`: ..._vllm.json).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

import psutil

from bench.adapter_common import embedded_engine, served_body, start_vllm, write_adapters
from bench.lib.common import (
    CpuWatch,
    machine,
    median,
    quiet_logs,
    table,
    wait_quiet_async,
    write_result,
)
from bench.lib.in_process_streams import new_record
from bench.lib.workload import mixed_requests


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--swaps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--max-loras", default="8,32")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--no-scale", action="store_true")
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    args = p.parse_args()
    args.max_loras = [int(n) for n in args.max_loras.split(",")]
    return args


async def stream(engine, ids: list[int], n: int, seed: int, adapter: str | None, rec: dict | None = None) -> dict:
    """One stream's record (`bench/lib/in_process_streams.py`'s shape, or `rec`): each chunk's time."""
    from flywheel.serve.engine import SamplingParams, TokenDelta

    rec = rec if rec is not None else new_record(adapter or "base")
    params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)
    try:
        if hasattr(engine, "generate_stream"):  # a client of an engine server (SGLang's protocol)
            return await _served_stream(engine, ids, params, adapter, rec)
        async for item in engine.stream(ids, params, adapter=adapter):
            if isinstance(item, TokenDelta):
                rec["chunks"].append(time.monotonic())
            else:
                rec["tokens"], rec["t_finish"] = len(item.output_ids), time.monotonic()
    except Exception as exc:  # noqa: BLE001 (recorded, as the client process records its requests)
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def _served_stream(client, ids: list[int], params, adapter: str | None, rec: dict) -> dict:
    tokens = 0
    async for chunk in client.generate_stream(served_body(ids, adapter, params.max_new_tokens, params.sampling_seed)):
        if chunk["output_ids"]:
            rec["chunks"].append(time.monotonic())
            tokens += len(chunk["output_ids"])
    rec["tokens"], rec["t_finish"] = tokens, time.monotonic()
    return rec


def max_gap(records: list[dict], start: float, end: float) -> float:
    """The longest gap between two tokens of a stream that ends inside [start, end]."""
    gaps = [b - a for rec in records for a, b in zip(rec["chunks"], rec["chunks"][1:]) if start <= b <= end]
    return max(gaps, default=0.0)


async def swap_run(engine, prompts, args, load=None) -> dict:
    """C streams; with `load` (k -> a coroutine loading alice's next version), K loads meanwhile."""
    await wait_quiet_async(max_wait_s=20)
    t0 = time.monotonic()
    records = [new_record("stream") for _ in prompts]
    tasks = [asyncio.ensure_future(stream(engine, ids, args.tokens, i, "alice" if i % 2 else None, rec))
             for i, (ids, rec) in enumerate(zip(prompts, records))]
    while not all(len(rec["chunks"]) >= 2 for rec in records):  # every stream decoding: prefills are over
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    windows = []
    for k in range(args.swaps):
        started = time.monotonic()
        if load:
            await load(k)
        else:
            await asyncio.sleep(0.005)  # the no-load run's stand-in for a load's stretch
        windows.append((started, time.monotonic()))
        await asyncio.sleep(0.4)
    await asyncio.gather(*tasks)
    assert not any(r["error"] for r in records), [r["error"] for r in records if r["error"]]
    span = (windows[0][0], windows[-1][1] + 0.1)
    return {"loads_ms": [round((b - a) * 1000, 1) for a, b in windows] if load else None,
            "max_gap_during_loads_ms": round(max(max_gap(records, a, b + 0.1) for a, b in windows) * 1000, 1),
            "max_gap_over_span_ms": round(max_gap(records, *span) * 1000, 1), "wall_s": round(time.monotonic() - t0, 2)}


async def swap_phase(args, workdir: Path, model, prompts) -> dict:
    versions = list(write_adapters(workdir / "swap", model, ["alice", "alice-next"], 8, seed=100).values())
    if args.engine == "vllm":
        from flywheel.serve.backends.vllm import VLLMEngineClient

        server = await asyncio.to_thread(start_vllm, args.model, workdir / "vllm", args.streams, 4, 8)
        engine = await VLLMEngineClient(server.url).connect()
        await engine.load_adapter("alice", str(versions[1]), 1)
        numbers = itertools.count(2)  # each version loaded under a name of its own: alice@v2, alice@v3, ...

        async def load(k: int) -> None:
            await engine.load_adapter("alice", str(versions[k % 2]), next(numbers))
    else:
        engine = await asyncio.to_thread(embedded_engine, args.model, args.streams, 8, workdir / "swap")

        async def load(k: int) -> None:
            await engine.load_adapter("alice", str(versions[k % 2]))
    runs = {"load": [], "none": []}
    try:
        await swap_run(engine, prompts, _short(args), load)  # warm-up
        for _ in range(args.repeats):
            for kind in ("none", "load"):
                run = await swap_run(engine, prompts, args, load if kind == "load" else None)
                runs[kind].append(run)
                print(f"  swap {kind}: max gap {run['max_gap_during_loads_ms']} ms (span {run['max_gap_over_span_ms']}), "
                      f"loads {run['loads_ms']}", flush=True)
    finally:
        if args.engine == "vllm":
            await engine.close()
            await asyncio.to_thread(server.stop)
        else:
            engine.stop()
    worst = {kind: max(r["max_gap_during_loads_ms"] for r in rs) for kind, rs in runs.items()}
    return {"runs": runs, "worst_gap_ms": worst, "stall_added_ms": round(worst["load"] - worst["none"], 1)}


def _short(args) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "tokens": 24, "swaps": 1})


def drop_from_page_cache(path: Path) -> None:
    """Evict one file's pages (this file only), so its next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def first_token_s(engine, ids: list[int], adapter: str | None) -> float:
    from flywheel.serve.engine import SamplingParams

    started = time.monotonic()
    await engine.generate(ids, SamplingParams(max_new_tokens=1, temperature=1.0), adapter=adapter)
    return time.monotonic() - started


async def churn(engine, prompts, names: list[str] | None, duration: float, seed: int) -> dict:
    """32 workers (one per prompt) for `duration` s, each request's adapter drawn from `names`."""
    rng = random.Random(seed)
    records: list[dict] = []
    deadline = time.monotonic() + duration
    await wait_quiet_async(max_wait_s=20)
    watch = CpuWatch().start()
    started = time.monotonic()

    async def worker(i: int) -> None:
        while time.monotonic() < deadline:
            records.append(await stream(engine, prompts[i], 32, rng.randrange(1 << 30), rng.choice(names) if names else None))

    await asyncio.gather(*(worker(i) for i in range(len(prompts))))
    wall = time.monotonic() - started
    tokens = sum(r["tokens"] or 0 for r in records)
    return {"tok_s": round(tokens / wall, 1), "requests": len(records), "errors": sum(bool(r["error"]) for r in records),
            "max_gap_ms": round(max_gap(records, started, started + wall) * 1000, 1), "foreign_cores": watch.stop()["foreign_cores"]}


async def scale_phase(args, workdir: Path, model, prompts) -> dict:
    root = workdir / "many"
    started = time.monotonic()
    paths = await asyncio.to_thread(write_adapters, root, model, [f"u{i:04d}" for i in range(args.adapters)], 8, 1000)
    names = list(paths)
    out: dict = {"adapters_on_disk": len(names), "write_s": round(time.monotonic() - started, 1),
                 "adapter_file_mb": round((paths[names[0]] / "adapter_model.safetensors").stat().st_size / 1e6, 2)}
    process = psutil.Process()
    cold_pool = iter(names[::-1])  # never read before their cold request
    for slots in args.max_loras:
        before = process.memory_info().rss
        engine = await asyncio.to_thread(embedded_engine, args.model, 32, slots, root)
        try:
            started_rss = process.memory_info().rss
            await asyncio.gather(*(first_token_s(engine, prompts[0], name) for name in names[:slots]))  # fill every slot
            table_bytes = sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size()
                              for s in engine.adapters.table.low_rank.values())
            memory = {"engine_start_rss_mb": round((started_rss - before) / 1e6), "slots_full_rss_mb": round(
                (process.memory_info().rss - started_rss) / 1e6), "slot_table_mb": round(table_bytes / 1e6, 1)}
            latency: dict[str, list[float]] = {"cold": [], "warm": [], "base": []}
            for _ in range(8):
                name = next(cold_pool)
                drop_from_page_cache(paths[name] / "adapter_model.safetensors")
                latency["cold"].append(await first_token_s(engine, prompts[1], name))
                latency["warm"].append(await first_token_s(engine, prompts[1], name))
                latency["base"].append(await first_token_s(engine, prompts[1], None))
            latency_ms = {kind: round(median(values) * 1000, 1) for kind, values in latency.items()}
            runs: dict[str, list] = {"base": [], "hot set": [], f"uniform over {len(names)}": []}
            for repeat in range(args.repeats):
                for kind, pool in zip(runs, (None, names[:slots], names)):
                    run = await churn(engine, prompts, pool, args.duration, repeat)
                    runs[kind].append(run)
                    print(f"  max_loras {slots} churn {kind}: {run}", flush=True)
        finally:
            engine.stop()
        out[f"max_loras={slots}"] = {"memory": memory, "first_token_ms": latency_ms, "churn": runs}
        print(f"  max_loras {slots}: {memory} {latency_ms}", flush=True)
    return out


async def main() -> None:
    args = parse_args()
    quiet_logs()
    from flywheel.models import load_model

    model, tokenizer = load_model(args.model)
    prompts = [r["prompt_ids"] for r in mixed_requests(tokenizer, 32, [args.tokens], [1], seed=0)]
    result: dict = {"machine": machine(None), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="adapter-swap-") as tmp:
        result["swap"] = await swap_phase(args, Path(tmp), model, prompts[:args.streams])
        if not args.no_scale and args.engine == "embedded":
            result["scale"] = await scale_phase(args, Path(tmp), model, prompts)
    swap = result["swap"]
    print(table(["", "worst gap during loads (ms)"], [[kind, gap] for kind, gap in swap["worst_gap_ms"].items()]))
    print("stall added by a load:", swap["stall_added_ms"], "ms")
    print("wrote", write_result(f"adapter_swap_{args.model}" + ("_vllm" if args.engine == "vllm" else ""), result))


if __name__ == "__main__":
    asyncio.run(main())
