"""The embedded engine's decode step, its chunked prefill and the engine alone (issue 26 part 2).

What it measures (SmolLM2-135M unless told, one torch thread: a serve loop that shares its cores)
    - step: the CPU time of one decode step (`KVBatch.step`) of B rows over ~L cached tokens
      each, per dtype, through transformers' forward and through the engine's own decoder
      (`flywheel/serve/engine/decoder.py`), run alternately and repeated, median reported; and the
      prefill rate (prompt tokens per CPU second) of one P-token prompt. CPU time of the
      engine's one thread, not wall time: the machine is shared, and another process's work
      lengthens the wall time of a step, hardly its CPU time.
    - run: the engine alone (`Engine.generate`, no gateway, no HTTP) on `bench/engines.py`'s
      workload (N chat prompts, C at a time, 16-256 tokens each, `ignore_eos`, temperature 1,
      each request seeded), with its decoder and with transformers' forward for decode steps
      (`--arms`), under each admission order (`--policies`, `serve.schedule_policy`), each run in
      a fresh process, alternating: useful tok/s, CPU seconds, decode steps, and the time to
      first token from a request's arrival at the engine, p50 and p90 (as `bench/engines.py`
      measures it through the gateway, less HTTP, the template and tokenizing).
    - long: B streams decoding (prompts of ~L tokens, `ignore_eos`), then one prompt of P tokens
      arrives: its time to first token and the longest gap between two tokens of the running
      streams from its arrival to its first token, per `chunked_prefill_size` (one large enough
      not to chunk: the engine before issue 26).

How to run (from the repository root)
    .venv/bin/python bench/engine_step.py --part step
    .venv/bin/python bench/engine_step.py --part run --dtype float32 --repeats 2
    .venv/bin/python bench/engine_step.py --part run --arms decoder --policies shortest-first,fcfs --name NAME
    .venv/bin/python bench/engine_step.py --part long --dtype bfloat16 --chunks 100000,512,256
    options: --model M --rows B --context L --prompt P --repeats R --dtypes float32,bfloat16
             --requests N --arms decoder,transformers --policies shortest-first,fcfs --name FILE

    Writes bench/results/engine_step_<part>_<model>[_<dtype>: run].json, or NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

import torch  # noqa: E402

from bench.lib.common import (  # noqa: E402
    machine,
    median,
    percentile,
    quiet_logs,
    table,
    wait_quiet,
    write_result,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["step", "run", "long"], required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--prompt", type=int, default=2048, help="the long prompt's tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--dtype", default="bfloat16", help="for --part run and long")
    p.add_argument("--chunks", default="100000,512,256", help="chunked_prefill_size values for --part long")
    p.add_argument("--requests", type=int, default=64, help="--part run: N requests, --rows at a time")
    p.add_argument("--arms", default="decoder,transformers", help="--part run: the decode forwards compared")
    p.add_argument("--policies", default="shortest-first", help="--part run: the admission orders compared")
    p.add_argument("--name", help="the results file's name, beginning engine_step_ (default engine_step_<part>_<model>[_<dtype>])")
    p.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm of --part run and print its JSON
    p.add_argument("--policy", default="shortest-first", help=argparse.SUPPRESS)  # internal: that arm's order
    return p.parse_args()


def prompts(rows: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length + i % 20,), generator=generator).tolist() for i in range(rows)]


def step_ms(model, rows: list[list[int]], decoder=None, steps: int = 10) -> float:
    from flywheel.serve.engine.kv_cache import KVBatch

    batch = KVBatch(model, len(rows))
    batch.add(batch.prefill(model, rows, 0))
    tokens = torch.tensor([r[-1] for r in rows])
    batch.step(model, tokens, decoder)  # warm-up
    started = time.thread_time()
    for _ in range(steps):
        batch.step(model, tokens, decoder)
    return 1000 * (time.thread_time() - started) / steps


def prefill_tok_s(model, length: int) -> float:
    from flywheel.serve.engine.chunked import PartialPrefill

    [sequence] = prompts(1, length, seed=1)
    started = time.thread_time()
    PartialPrefill().advance(model, sequence, len(sequence))
    return len(sequence) / (time.thread_time() - started)


def part_step(args) -> dict:
    from flywheel.models import load_model
    from flywheel.serve.engine.decoder import Decoder

    rows = prompts(args.rows, args.context)
    out: dict = {}
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            model, _ = load_model(args.model, getattr(torch, dtype))
            decoder = Decoder.build(model, args.rows)
            prefill_tok_s(model, 64)  # warm-up
            for _ in range(args.repeats):
                wait_quiet(max_wait_s=30)
                for name, forward in (("transformers", None), ("decoder", decoder)):
                    out.setdefault(f"{dtype} {name}", []).append(round(step_ms(model, rows, forward), 1))
                out.setdefault(f"{dtype} prefill", []).append(round(prefill_tok_s(model, args.prompt)))
    return out


async def run_arm(args) -> dict:
    """The engine alone on bench/engines.py's workload, `--rows` requests at a time, decode steps
    through `args.arm`, waiting requests admitted in `args.policy`'s order."""
    from transformers import AutoTokenizer

    from bench.lib.workload import uniform_requests
    from flywheel.models import load_model, resolve_model
    from flywheel.serve.engine import Engine, SamplingParams

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    requests = uniform_requests(AutoTokenizer.from_pretrained(resolve_model(args.model)), args.requests, seed=0)
    engine = Engine(model, tokenizer, max_batch_size=args.rows, own_decoder=args.arm == "decoder",
                    schedule_policy=args.policy).start()
    slots = asyncio.Semaphore(args.rows)

    async def generate(i: int, request: dict, max_new_tokens: int):
        async with slots:
            return await engine.generate(request["prompt_ids"], SamplingParams(
                max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=i))
    try:
        await asyncio.gather(*(generate(i, r, 8) for i, r in enumerate(requests[:4])))  # warm-up
        steps = engine.stats["steps"]
        wall, cpu = time.monotonic(), time.process_time()
        results = await asyncio.gather(*(generate(i, r, r["max_new_tokens"]) for i, r in enumerate(requests)))
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    finally:
        engine.stop()
    useful = sum(r["max_new_tokens"] for r in requests)
    assert sum(len(r.output_ids) for r in results) == useful
    ttft = [r.first_token_s for r in results]
    return {"arm": args.arm, "policy": args.policy, "dtype": args.dtype, "useful_tok_s": round(useful / wall, 1),
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "decode_steps": engine.stats["steps"] - steps,
            "ttft_p50_s": round(percentile(ttft, 50), 3), "ttft_p90_s": round(percentile(ttft, 90), 3)}


def part_run(args) -> list[dict]:
    results = []
    for _ in range(args.repeats):
        for arm in args.arms.split(","):
            for policy in args.policies.split(","):
                wait_quiet(max_wait_s=30)
                child = subprocess.run([sys.executable, __file__, "--part", "run", "--arm", arm, "--policy", policy,
                                        "--dtype", args.dtype, "--model", args.model, "--rows", str(args.rows),
                                        "--requests", str(args.requests)], capture_output=True, text=True, check=True)
                results.append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(results[-1], flush=True)
    return results


async def long_prompt(args, chunk: int) -> dict:
    from flywheel.models import load_model
    from flywheel.serve.engine import Engine, SamplingParams

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    engine = Engine(model, tokenizer, max_batch_size=args.rows + 1, chunked_prefill_size=chunk).start()
    try:
        arrivals: list[list[float]] = [[] for _ in range(args.rows)]

        async def stream(i: int, ids: list[int]) -> None:
            params = SamplingParams(max_new_tokens=100_000, temperature=1.0, ignore_eos=True)
            async for _ in engine.stream(ids, params):
                arrivals[i].append(time.monotonic())

        running = [asyncio.create_task(stream(i, ids)) for i, ids in enumerate(prompts(args.rows, args.context))]
        while min(len(a) for a in arrivals) < 8:  # every stream decoding
            await asyncio.sleep(0.05)
        [long] = prompts(1, args.prompt, seed=2)
        sent = time.monotonic()
        await engine.generate(long, SamplingParams(max_new_tokens=1))
        first = time.monotonic()
        await engine.abort()
        await asyncio.gather(*running, return_exceptions=True)
    finally:
        engine.stop()
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b >= sent and a <= first]
    before = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b < sent]
    return {"chunked_prefill_size": chunk, "ttft_s": round(first - sent, 3), "max_gap_s": round(max(gaps), 3),
            "median_gap_before_s": round(median(before), 3)}


def part_long(args) -> list[dict]:
    results = []
    for _ in range(args.repeats):
        for chunk in (int(c) for c in args.chunks.split(",")):
            wait_quiet(max_wait_s=30)
            results.append(asyncio.run(long_prompt(args, chunk)))
            print(results[-1], flush=True)
    return results


def main() -> None:
    args = parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    if args.arm:
        print(json.dumps(asyncio.run(run_arm(args))), flush=True)
        return
    if args.part == "step":
        result = part_step(args)
        rows = [[name, *values, median(values)] for name, values in result.items()]
        print(table(["what", *[f"run {i + 1}" for i in range(args.repeats)], "median"], rows))
        print(f"(decode: CPU ms per step at {args.rows} rows x ~{args.context + 10} tokens; prefill: tok/s of {args.prompt} tokens)")
    elif args.part == "run":
        result = part_run(args)
        print(table(["arm", "policy", "dtype", "useful tok/s", "CPU s", "decode steps", "TTFT p50 s", "p90 s"],
                    [[r["arm"], r["policy"], r["dtype"], r["useful_tok_s"], r["cpu_s"], r["decode_steps"],
                      r["ttft_p50_s"], r["ttft_p90_s"]] for r in result]))
    else:
        result = part_long(args)
    name = args.name or f"engine_step_{args.part}_{args.model}" + (f"_{args.dtype}" if args.part == "run" else "")
    path = write_result(name, {"machine": machine(1), "args": vars(args), "results": result,
                                                                  "command": " ".join(["python", *sys.argv])})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
