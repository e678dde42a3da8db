"""Engines behind the gateway, side by side in one run: the embedded engine and a vLLM server,
and Hugging Face's static `generate` as the floor.

What it measures
    The same seeded workload through the Flywheel gateway (`flywheel.serve.loop.ServeLoop`, the official
    OpenAI route `/v1/chat/completions`, streamed) backed by each engine in turn, each alone on
    the machine: N chat prompts (`bench/lib/workload.py`, the gateway's chat template), C at a time,
    each asking for a length drawn uniformly from [16, 256] tokens with `ignore_eos` at
    temperature 1, so every request produces exactly what it asked for.

    - useful tok/s: the requested tokens over the wall time of the whole batch;
    - TTFT: time to first token of each request, from its send (p50, p90);
    - hot-swap stall: with C streams of 256 tokens running, a new version is announced on the bus
      and the gateway swaps it in (`EnginePool.swap`: pause, load, resume); reported are the
      pause the gateway measured and the stall streams saw: the longest gap between two tokens
      of a stream that overlaps the time from the announcement to the swap's end (against the
      longest gap of the throughput phase, `max gap`: a step that prefills newcomers stalls
      the running streams too).

    `process` (in `--engines`): the embedded engine in a process of its own (`python -m
    serve.engine`, SGLang's protocol over HTTP, as vLLM's engine is a process of its own), the
    gateway its client through `serve.engine_urls`.
    `hf` (in `--engines`): `model.generate` in static batches of C on the same requests
    (`bench/engine_throughput.py`'s baseline: each batch runs to its longest request, sampled at
    temperature 1), in a child process with the same torch threads and dtype. No server, no
    streams: only its useful tok/s; a request's first token waits for every earlier batch.

    The embedded engine runs with `serve.own_decoder` on (its own decode step).

    The load runs in a child process (`bench/lib/route_load.py`), so its work does not compete
    with the gateway's for the GIL. The embedded engine runs on `serve.torch_threads` (every core unless told);
    vLLM's model runs unpinned, free to use every core (`VLLM_CPU_OMP_THREADS_BIND=nobind`, as the serve loop
    starts it; until 2026-11-27 (docs/experiments/engines-side-by-side.md, engine-vs-vllm.md) it ran pinned to one core, the CPU build's default). Both
    in `--dtype` (float32 unless told: the embedded engine's `serve.dtype`, vLLM's `--dtype`).
    Also, per engine: the gap between the log-probs it records and the float32 model's own
    (log softmax(logits / T) on the same prefix, as the trainer recomputes them: the trainer's
    `behav_logprob_gap`) over 8 answers of 64 tokens at temperature 1 and 0.7. With `--repeats R`
    the engines run R times each, alternating (embedded, vLLM, embedded, ...): the machine is
    shared, and one run of each says little about which is faster. With `--routes`, vLLM's two token-returning routes are also compared directly (no
    gateway): `/inference/v1/generate` (what `flywheel.serve.backends.vllm` uses) against `/v1/completions`
    with `return_token_ids` and logprobs, by tok/s and by the CPU seconds vLLM's API server
    spends per 1000 tokens (its cost, steadier than throughput on a shared machine).

How to run (from the repository root)
    .venv/bin/python bench/engines.py                       # SmolLM2-135M, N=64, C=32
    .venv/bin/python bench/engines.py --model tiny --requests 32 --routes
    .venv/bin/python bench/engines.py --dtype bfloat16 --repeats 2 --engines embedded,vllm,hf
    options: --engines embedded,process,vllm,hf --requests N --concurrency C --seed S --dtype D --repeats R
             --torch-threads T --chunked-prefill-size P --schedule-policy S --max-stall-s S (the embedded engine's)
             --name FILE

    Writes bench/results/engines_<model>[_<dtype>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    CpuWatch,
    machine,
    median,
    percentile,
    quiet_logs,
    table,
    wait_quiet_async,
    write_result,
)
from bench.lib.route_load import Load  # noqa: E402
from bench.lib.workload import uniform_requests  # noqa: E402
from flywheel.cli import command  # noqa: E402
from flywheel.serve.engine.cpu_threads import torch_threads  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engines", default="embedded,vllm")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' weights and KV cache")
    p.add_argument("--repeats", type=int, default=1, help="runs of each engine, alternating")
    p.add_argument("--torch-threads", type=int,
                   help="the embedded engine's serve.torch_threads (and HF generate's); default: every core, as serve's default")
    p.add_argument("--chunked-prefill-size", type=int, help="the embedded engine's serve.chunked_prefill_size (default: serve's)")
    p.add_argument("--schedule-policy", choices=["shortest-first", "fcfs"], help="the embedded engine's serve.schedule_policy (default: serve's)")
    p.add_argument("--max-stall-s", type=float, help="the embedded engine's serve.max_stall_s (default: serve's)")
    p.add_argument("--name", help="the result file's name, beginning engines_ (default: engines_<model>[_<dtype>])")
    p.add_argument("--routes", action="store_true", help="also compare vLLM's generate and completions routes")
    args = p.parse_args()
    args.torch_threads = torch_threads(args.torch_threads)
    return args


# ---- phases ----------------------------------------------------------------------------------

def summary(records: list[dict], wall: float, useful: int) -> dict:
    errors = [r["error"] for r in records if r["error"]]
    ttft = [r["t_first"] - r["t_send"] for r in records if r["t_first"]]
    return {"useful_tokens": useful, "received_tokens": sum(r["tokens"] for r in records), "wall_s": round(wall, 2),
            "useful_tok_s": round(useful / wall, 1), "ttft_p50_s": round(median(ttft), 3), "ttft_p90_s": round(percentile(ttft, 90), 3),
            "max_token_gap_s": round(max(r["max_gap"] for r in records), 3), "errors": errors[:3], "n_errors": len(errors)}


async def throughput(url: str, model: str, requests: list[dict], args, workdir: Path, route: str = "chat") -> dict:
    cfg = {"url": url, "model": model, "route": route, "concurrency": args.concurrency, "seed": args.seed, "requests": requests}
    await Load({**cfg, "requests": requests[:4]}, workdir).run()  # warm-up, untimed
    quiet = await wait_quiet_async()
    watch = CpuWatch().start()
    started = time.monotonic()
    records = await Load(cfg, workdir).run()
    wall = time.monotonic() - started
    return {**summary(records, wall, sum(r["max_new_tokens"] for r in requests)), "cpu": watch.stop(), "quiet_wait": quiet}


async def hot_swap(served, model_spec: str, requests: list[dict], args, workdir: Path, version: int) -> dict:
    """C streams of 256 tokens; once tokens flow, announce `version` and let the gateway swap."""
    from flywheel.bus import WEIGHTS_SUBJECT, Bus, WeightUpdate

    path = str(workdir / "store" / f"v{version}")
    long = [dict(r, max_new_tokens=256) for r in requests[: args.concurrency]]
    cfg = {"url": served.url, "model": model_spec, "route": "chat", "concurrency": args.concurrency, "seed": args.seed,
           "requests": long, "signal_after": 8 * args.concurrency}
    bus = await Bus.connect(served.nats_url, name="bench")
    swaps = served.loop.stats()["swaps"]
    window: list[float] = []

    async def swapped() -> None:
        while served.loop.stats()["swaps"] == swaps:
            await asyncio.sleep(0.005)
        window.append(time.monotonic())

    async def announce() -> None:
        window.append(time.monotonic())
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"bench-w{version}", version=version, path=path, step=version))

    try:
        waiter = asyncio.create_task(swapped())
        records = await Load(cfg, workdir).run(on_flowing=announce)
        await asyncio.wait_for(waiter, 60)
    finally:
        await bus.close()
    errors = [r["error"] for r in records if r["error"]]
    announced, done = window
    across = [now - last for r in records for last, now in r["gaps"] if last <= done and now >= announced]
    return {"pause_s": round(served.loop.pauses[-1], 3), "announce_to_swapped_s": round(done - announced, 3),
            "stall_s": round(max(across, default=0.0), 3), "max_token_gap_s": round(max(r["max_gap"] for r in records), 3),
            "n_errors": len(errors), "errors": errors[:3]}


@contextlib.asynccontextmanager
async def engine_process(args):
    """`flywheel engine` on a free port (the embedded engine as a server of its own)."""
    child = await asyncio.create_subprocess_exec(
        *command("engine"), "--model", args.model, "--port", "0", "--dtype", args.dtype,
        "--torch-threads", str(args.torch_threads), "--max-running-requests", str(args.concurrency),
        "--incremental-streaming-output", "--own-decoder", stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
    try:
        while not (line := (await child.stdout.readline()).decode()).startswith("engine serving"):
            if not line:
                raise RuntimeError("flywheel engine did not start")
        yield line.rsplit(" at ", 1)[1].strip()
    finally:
        child.terminate()
        await child.wait()


HF_GENERATE = """
import json, sys, torch
from bench.engine_throughput import run_static
from flywheel.models import load_model
cfg = json.loads(open(sys.argv[1]).read())
torch.set_num_threads(cfg["threads"])
model, tokenizer = load_model(cfg["model"], getattr(torch, cfg["dtype"]))
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
run_static(model, pad, cfg["requests"][:4], 4)  # warm-up, untimed
print(json.dumps(run_static(model, pad, cfg["requests"], cfg["batch"])))
"""


async def bench_hf(args, requests: list[dict], workdir: Path) -> dict:
    """Static `generate` batches in a child process (see the module docstring)."""
    path = workdir / "hf.json"
    path.write_text(json.dumps({"threads": args.torch_threads, "model": args.model, "dtype": args.dtype,
                                "requests": requests, "batch": args.concurrency}))
    await wait_quiet_async()
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", HF_GENERATE, str(path), stdout=asyncio.subprocess.PIPE,
                                                 cwd=Path(__file__).resolve().parent.parent)
    out, _ = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError("HF generate failed")
    run = json.loads(out.decode().strip().splitlines()[-1])
    print(f"hf: {run['tokens_per_s']:.1f} useful tok/s (static batches of {args.concurrency})", flush=True)
    return {"start_s": None, "static": run,
            "throughput": {"useful_tok_s": round(run["tokens_per_s"], 1), "wall_s": round(run["wall_s"], 2), "ttft_p50_s": None,
                           "ttft_p90_s": None, "max_token_gap_s": None, "n_errors": 0, "cpu": run["cpu"]},
            "hot_swap": {"pause_s": None, "stall_s": None, "n_errors": 0}}


async def bench_engine(engine: str, args, requests: list[dict], workdir: Path) -> dict:
    from bench.lib.served import Served

    if engine == "hf":
        return await bench_hf(args, requests, workdir)
    if engine == "process":
        async with engine_process(args) as url:
            return await bench_engine(f"gateway to {url}", args, requests, workdir)

    overrides = ["serve.max_batch_size=32", "serve.max_new_tokens=256", f"serve.dtype={args.dtype}",
                 f"serve.torch_threads={args.torch_threads}", "serve.own_decoder=true"]
    if args.chunked_prefill_size:
        overrides.append(f"serve.chunked_prefill_size={args.chunked_prefill_size}")
    if args.schedule_policy:
        overrides.append(f"serve.schedule_policy={args.schedule_policy}")
    if args.max_stall_s is not None:
        overrides.append(f"serve.max_stall_s={args.max_stall_s}")
    if engine.startswith("gateway to "):
        overrides.append(f"serve.engine_urls=[{engine.removeprefix('gateway to ')}]")
    if engine == "vllm":
        overrides.append("serve.engine_kind=vllm")
        os.environ["FLYWHEEL_VLLM_ARGS"] = f"--dtype {args.dtype}"
    started = time.monotonic()
    async with Served(args.model, overrides) as served:
        result = {"start_s": round(time.monotonic() - started, 1)}
        print(f"{engine}: started in {result['start_s']}s", flush=True)
        result["throughput"] = await throughput(served.url, served.loop.model_name, requests, args, workdir)
        print(f"{engine}: {result['throughput']['useful_tok_s']} useful tok/s", flush=True)
        result["sampled"] = await sampled(served, requests)  # on the weights it started with, before the swap
        result["hot_swap"] = await hot_swap(served, served.loop.model_name, requests, args, workdir, version=1)
        print(f"{engine}: swap paused {result['hot_swap']['pause_s']}s, streams stalled {result['hot_swap']['stall_s']}s", flush=True)
        if engine == "vllm" and args.routes:
            result["routes"] = await routes(served, requests, args, workdir)
    return result


async def sampled(served, requests: list[dict]) -> list[dict]:
    """8 answers of 64 tokens sampled by the engine (at temperature 1 and 0.7) with their recorded
    log-probs, for `logprob_gap` (after the run: torch work here would slow an embedded engine)."""
    [engine] = served.loop.pool.engines
    bodies = [{"input_ids": r["prompt_ids"], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 64, "temperature": 1.0 if i % 2 else 0.7, "ignore_eos": True, "sampling_seed": i}}
        for i, r in enumerate(requests[:8])]
    answers = await asyncio.gather(*(engine.generate(body) for body in bodies))
    return [{"prompt_ids": b["input_ids"], "temperature": b["sampling_params"]["temperature"], "output_ids": a["output_ids"],
             "logprobs": [e[0] for e in a["meta_info"]["output_token_logprobs"]]} for b, a in zip(bodies, answers)]


def logprob_gap(model_spec: str, sampled: list[dict]) -> dict:
    """|log π − log π_engine| per sampled token, π the float32 model's log softmax(logits / T) on
    the same prefix: what the trainer's `behav_logprob_gap` is for tokens of its own version."""
    import torch

    from flywheel.models import load_model

    model, _ = load_model(model_spec)
    gaps = []
    for s in sampled:
        ids = torch.tensor([s["prompt_ids"] + s["output_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s["prompt_ids"]) - 1: -1].float() / s["temperature"]
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(s["output_ids"]).unsqueeze(1)).squeeze(1)
        gaps += (mine - torch.tensor(s["logprobs"])).abs().tolist()
    return {"tokens": len(gaps), "mean": sum(gaps) / len(gaps), "max": max(gaps)}


async def routes(served, requests: list[dict], args, workdir: Path) -> dict:
    """vLLM's routes directly: tok/s and its API server's CPU per 1000 tokens."""
    [engine] = served.loop.pool.engines
    pid = served.loop.vllm_server.pid
    out = {}
    for route in ("generate", "completions", "generate", "completions"):  # interleaved, twice
        before = _cpu_s(pid)
        result = await throughput(engine.name, served.loop.model_name, requests, args, workdir, route=route)
        result["api_server_cpu_s_per_1k_tokens"] = round(1000 * (_cpu_s(pid) - before) / result["received_tokens"], 3)
        out.setdefault(route, []).append(result)
        print(f"route {route}: {result['useful_tok_s']} tok/s, API server {result['api_server_cpu_s_per_1k_tokens']} CPU s/1k tokens",
              flush=True)
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PUBLISH = """
import sys, torch
from pathlib import Path
from flywheel.models import WeightStore, load_model
from flywheel.cli import command
model, _ = load_model(sys.argv[1])
generator = torch.Generator().manual_seed(int(sys.argv[3]))
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 0.01 * p.std())
WeightStore(Path(sys.argv[2]) / "store", keep=2).publish(model, int(sys.argv[3]))
"""
"""A perturbed copy of the model published as a version, in a child process: torch work on a
second thread of this process would slow the embedded engine's thread for good (docs/benchmarks.md,
odd things found, 1)."""


async def main_async(args) -> dict:
    from transformers import AutoTokenizer

    from flywheel.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    requests = uniform_requests(tokenizer, args.requests, args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="flywheel-engines-") as tmp:
        workdir = Path(tmp)
        publish = await asyncio.create_subprocess_exec(sys.executable, "-c", PUBLISH, args.model, str(workdir), "1",
                                                       cwd=Path(__file__).resolve().parent.parent)
        if await publish.wait() != 0:
            raise RuntimeError("could not publish the swap's weights")
        for _ in range(args.repeats):
            for engine in args.engines.split(","):
                results.setdefault(engine, []).append(await bench_engine(engine, args, requests, workdir))
    for engine, runs in results.items():
        if "sampled" not in runs[0]:
            continue
        runs[0]["logprob_gap"] = logprob_gap(args.model, runs[0]["sampled"])
        print(f"{engine}'s log-probs against the float32 model's: {runs[0]['logprob_gap']}", flush=True)
        for run in runs:
            del run["sampled"]
    return results


def main() -> None:
    args = parse_args()
    quiet_logs()
    results = asyncio.run(main_async(args))
    rows = [[engine, r["start_s"], r["throughput"]["useful_tok_s"], r["throughput"]["ttft_p50_s"], r["throughput"]["ttft_p90_s"],
             r["throughput"]["max_token_gap_s"], r["hot_swap"]["pause_s"], r["hot_swap"]["stall_s"],
             r["throughput"]["n_errors"] + r["hot_swap"]["n_errors"], r["throughput"]["cpu"]["foreign_cores"]]
            for engine, runs in results.items() for r in runs]
    print(table(["engine", "start s", "useful tok/s", "TTFT p50 s", "TTFT p90 s", "max gap s", "swap pause s",
                 "swap stall s", "errors", "foreign cores"], rows))
    name = args.name or f"engines_{args.model}" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    path = write_result(name, {"machine": machine(1), "args": vars(args), "results": results,
                                                   "command": " ".join(["python", *sys.argv])})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
