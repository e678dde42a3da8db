"""The GPU path: the embedded engine on CUDA against HF `generate`, one decode step profiled, the
engine's behaviour log-probs against the trainer's recompute, and `Trainer.step` on CUDA.

What it measures (every part in one process, one model shape; `--parts` picks them)
    engine    The workload of `bench/engine_throughput.py` (`bench/lib/workload.py`: chat prompts of
              4-240 words, `max_new_tokens` drawn, seeded, from 8..256 with weights
              32:16:8:4:2:1, temperature 1, `ignore_eos`), N = `--per-slot` x B requests, for each
              `--dtypes` x `--batches` (B = max_batch_size): all N submitted at once to
              `flywheel.serve.engine.Engine` (default `chunked_prefill_size` 512; at the largest B also
              `--wide-prefill`); then HF `model.generate` on the same model object and requests
              in static batches of B (left padding, sampling at temperature 1, each batch run to
              its longest request). Useful tokens/s (the sum of the requested lengths / wall),
              TTFT p50/p90 (from submission; all N arrive at t=0, so it includes queueing; for
              the static side, the time the request's batch produced its first token), decode
              steps, peak GPU memory. The dtype is the engine's `serve.dtype`: weights and KV
              cache (`load_model(dtype)` then `place`, as `flywheel/serve/loop.py` does).
    profile   At B = `--profile-batch` rows, each with ~a prompt plus 4 tokens cached: the
              engine is paused in place and its own decode step (`Engine._decode`: forward,
              sampling, per-request bookkeeping) is called directly: wall ms per step (synced),
              ms per bare forward (`KVBatch.step`), and under torch.profiler the GPU kernel time
              and kernel count per step. GPU idle = 1 - kernel time / step wall.
    logprobs  `--lp-requests` chat prompts x `--lp-tokens` tokens sampled (temperature 1) by the
              engine at each dtype, then the trainer (`flywheel.train.trainer.Trainer`, float32 weights,
              `train.autocast`: bf16 autocast on CUDA, as `train.device: cuda` runs) recomputes every sampled
              token: mean and max |engine logprob - trainer logprob| (`behav_logprob_gap`), the
              behaviour weight pi_prox/pi_behav = exp(gap) (mean, extremes, the share outside the
              PPO clip range 1 +- eps and above `actor.behav_imp_weight_cap`), and the same against
              a float32 recompute (`train.autocast: false`).
    train     `Trainer.step` on the workload of `bench/trainer_efficiency.py` (`--train-samples`
              samples, prompts 30-200 + outputs 8..256, random ids), packed micro-batches of
              `--budget` tokens: standard PPO, decoupled PPO (+ the pi_prox pass), decoupled PPO in
              float32 (`train.autocast: false`), and a bare
              loop (forward under the same autocast, -A*logp, backward, clip, AdamW). Median step
              time of `--repeats` after a warm-up, real and computed tokens/s, peak GPU memory.
    fsdp      The decoupled step once more with `train.fsdp: true` on a one-rank NCCL group.

`--random-weights` builds the model from the config of `--model` with seeded random weights
(`AutoModelForCausalLM.from_config`): timings with `ignore_eos` do not depend on the weights,
log-prob gaps do (random weights give near-uniform, small logits), so read those on real ones.

How to run (from the repository root)
    .venv/bin/python bench/gpu_path.py --model tiny --device cpu --quick     # CPU smoke test, ~1 min
    python3 bench/gpu_path.py --model DIR --device cuda                       # the numbers (docs/experiments/gpu-path.md)
    options: --dtypes float32,bfloat16 --batches 32,64,128,256 --parts engine,profile,logprobs,train,fsdp
Writes bench/results/gpu_path_<name>.json (`--name`, default the model's and device's names).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    bench_model,
    machine,
    median,
    percentile,
    quiet_logs,
    table,
    write_result,
)
from bench.lib.gpu_train import logprob_part, train_part  # noqa: E402
from bench.lib.workload import mixed_requests  # noqa: E402

LENGTHS, WEIGHTS = [8, 16, 32, 64, 128, 256], [32, 16, 8, 4, 2, 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model spec or directory (its config and tokenizer)")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights of the model's shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="32,64,128,256")
    p.add_argument("--per-slot", type=int, default=4, help="requests per batch slot: N = per_slot x B")
    p.add_argument("--repeats", type=int, default=2, help="engine runs per configuration (static: 1)")
    p.add_argument("--wide-prefill", type=int, default=4096, help="chunked_prefill_size of the extra run at the largest B")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--lp-dtypes", default="float32,bfloat16", help="engine dtypes of the logprobs part")
    p.add_argument("--lp-requests", type=int, default=32)
    p.add_argument("--lp-tokens", type=int, default=64)
    p.add_argument("--train-samples", type=int, default=256)
    p.add_argument("--budget", type=int, default=16384, help="train.micro_batch_tokens")
    p.add_argument("--train-repeats", type=int, default=5)
    p.add_argument("--parts", default="engine,profile,logprobs,train,fsdp")
    p.add_argument("--quick", action="store_true", help="small sizes for a CPU smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-static", action="store_true", help="the engine part without its HF generate baseline")
    p.add_argument("--no-cudnn-sdp", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False): attention without cuDNN's SDPA kernels")
    p.add_argument("--name")
    p.add_argument("--out", help="also copy the result file into this folder after each part")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.per_slot, args.repeats, args.profile_batch, args.profile_steps = "4,8", 2, 1, 4, 3
        args.lp_requests, args.lp_tokens, args.train_samples, args.budget, args.train_repeats = 4, 8, 8, 1024, 1
        args.lengths, args.weights = [4, 8, 16], [4, 2, 1]
    else:
        args.lengths, args.weights = LENGTHS, WEIGHTS
    args.dtypes, args.lp_dtypes = args.dtypes.split(","), args.lp_dtypes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.parts = set(args.parts.split(","))
    return args


# ---- the model ------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def build(args: argparse.Namespace, dtype: str):
    """(model on args.device in `dtype`, tokenizer): `bench_model` with this run's options."""
    return bench_model(args.model, dtype, args.device, args.random_weights, args.seed)


# ---- engine against static batches -------------------------------------------------------------

def run_engine(engine, requests: list[dict], device: str) -> dict:
    from flywheel.serve.engine import SamplingParams

    async def go() -> list:
        return await asyncio.gather(*(
            engine.generate(r["prompt_ids"], SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=1.0, ignore_eos=True))
            for r in requests))

    before = dict(engine.stats)
    sync(device)
    started = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - started
    useful = sum(r["max_new_tokens"] for r in requests)
    assert sum(len(r.output_ids) for r in results) == useful, "the engine stopped a request early"
    ttft = [r.first_token_s for r in results]
    steps = engine.stats["steps"] - before["steps"]
    return {"wall_s": wall, "useful_tokens": useful, "tokens_per_s": useful / wall, "decode_steps": steps,
            "prefills": engine.stats["prefills"] - before["prefills"], "ttft_p50_s": median(ttft),
            "ttft_p90_s": percentile(ttft, 90), "mean_rows_per_step": useful / max(1, steps)}


class FirstToken:
    """A `generate` streamer noting when the first new token of its batch came (its second put)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def run_static(model, pad_id: int, requests: list[dict], batch: int, device: str) -> dict:
    """HF `generate` in static batches of `batch`, each run to its longest request."""
    sync(device)
    started = time.perf_counter()
    ttft, computed = [], 0
    for at in range(0, len(requests), batch):
        group = requests[at: at + batch]
        longest = max(r["max_new_tokens"] for r in group)
        width = max(len(r["prompt_ids"]) for r in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, width - len(r["prompt_ids"]):] = torch.tensor(r["prompt_ids"])
            mask[i, width - len(r["prompt_ids"]):] = 1
        streamer = FirstToken()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=pad_id, streamer=streamer)
        assert out.shape[1] == width + longest, "a static batch stopped early"
        ttft += [streamer.at - started] * len(group)
        computed += len(group) * longest
    sync(device)
    wall = time.perf_counter() - started
    useful = sum(r["max_new_tokens"] for r in requests)
    return {"wall_s": wall, "useful_tokens": useful, "tokens_per_s": useful / wall, "computed_tokens": computed,
            "useful_fraction": useful / computed, "ttft_p50_s": median(ttft), "ttft_p90_s": percentile(ttft, 90)}


def engine_part(args: argparse.Namespace, dtype: str, result: dict) -> None:
    from flywheel.serve.engine import Engine

    model, tokenizer = build(args, dtype)
    pad_id = Engine(model, tokenizer).pad_id
    for batch in args.batches if "engine" in args.parts else []:
        requests = mixed_requests(tokenizer, args.per_slot * batch, args.lengths, args.weights, args.seed)
        warm = [dict(r, max_new_tokens=min(8, r["max_new_tokens"])) for r in requests[:batch]]
        prefill_sizes = [512] + ([args.wide_prefill] if batch == max(args.batches) else [])
        for prefill in prefill_sizes:
            free(args.device)
            engine = Engine(model, tokenizer, max_batch_size=batch, chunked_prefill_size=prefill).start()
            try:
                run_engine(engine, warm, args.device)  # untimed: kernels, handles, the cache's first allocation
                runs = [run_engine(engine, requests, args.device) for _ in range(args.repeats)]
            finally:
                engine.stop()
            del engine
            row = {"dtype": dtype, "batch": batch, "requests": len(requests), "path": "engine", "chunked_prefill_size": prefill,
                   "runs": runs, "tokens_per_s": median([r["tokens_per_s"] for r in runs]), "peak_gib": peak_gib(args.device),
                   **{k: runs[-1][k] for k in ("ttft_p50_s", "ttft_p90_s", "decode_steps", "mean_rows_per_step")}}
            result["engine"].append(row)
            print(f"  {dtype} B={batch} engine(prefill {prefill}): {row['tokens_per_s']:.0f} tok/s, TTFT p50 "
                  f"{row['ttft_p50_s']:.3f}s, {row['decode_steps']} steps, peak {row['peak_gib']} GiB", flush=True)
        if args.no_static:
            continue
        free(args.device)
        run_static(model, pad_id, warm, batch, args.device)
        run = run_static(model, pad_id, requests, batch, args.device)
        result["engine"].append({"dtype": dtype, "batch": batch, "requests": len(requests), "path": "static",
                                 "peak_gib": peak_gib(args.device), **run})
        print(f"  {dtype} B={batch} static: {run['tokens_per_s']:.0f} tok/s, TTFT p50 {run['ttft_p50_s']:.3f}s", flush=True)
    if "profile" in args.parts:
        result["profile"].append(profile_part(args, model, tokenizer, dtype))
    del model
    free(args.device)


# ---- one decode step, profiled -------------------------------------------------------------------

def profile_part(args: argparse.Namespace, model, tokenizer, dtype: str) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from flywheel.serve.engine import Engine, SamplingParams

    rows, steps = args.profile_batch, args.profile_steps
    engine = Engine(model, tokenizer, max_batch_size=rows, chunked_prefill_size=args.wide_prefill).start()
    requests = mixed_requests(tokenizer, rows, [1], [1], args.seed + 1)
    out: dict = {"dtype": dtype, "rows": rows, "steps": steps}

    def timed(fn) -> float:
        sync(args.device)
        started = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(args.device)
        return 1e3 * (time.perf_counter() - started) / steps

    async def go() -> None:
        params = SamplingParams(max_new_tokens=4 * steps + 64, temperature=1.0, ignore_eos=True)
        tasks = [asyncio.ensure_future(engine.generate(r["prompt_ids"], params)) for r in requests]
        while engine.load()["num_running_reqs"] < rows or engine.stats["steps"] < 4:
            await asyncio.sleep(0.001)
        await engine.pause("in_place")  # the worker thread now waits; this thread steps the engine
        out["cached_tokens_per_row"] = engine.load()["cached_tokens"] / rows
        with torch.inference_mode():
            timed(engine._decode)  # warm
            out["decode_step_ms"] = timed(engine._decode)
            out["decode_step_ms_again"] = timed(engine._decode)
            tokens = torch.tensor([r.output_ids[-1] for r in engine._rows])
            out["forward_ms"] = timed(lambda: engine._batch.step(engine.model, tokens))
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    engine._decode()
                sync(args.device)
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in kernels)
        out["gpu_kernel_ms_per_step"] = gpu_us / 1e3 / steps
        out["kernels_per_step"] = sum(e.count for e in kernels) / steps
        out["gpu_idle_fraction"] = 1 - out["gpu_kernel_ms_per_step"] / out["decode_step_ms"] if kernels else None
        out["top_kernels"] = [[e.key[:90], round(e.self_device_time_total / 1e3 / steps, 4), e.count // steps]
                              for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]]
        cpu_ops = sorted((e for e in averages if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
        out["top_cpu_ops"] = [[e.key[:60], round(e.self_cpu_time_total / 1e3 / steps, 3), e.count // steps] for e in cpu_ops[:12]]
        out["cpu_ops_per_step"] = sum(e.count for e in cpu_ops) / steps
        await engine.resume()
        await engine.abort()
        await asyncio.gather(*tasks)

    try:
        asyncio.run(go())
    finally:
        engine.stop()
    print(f"  {dtype} profile B={rows}: step {out['decode_step_ms']:.2f} ms (forward {out['forward_ms']:.2f}), GPU kernels "
          f"{out['gpu_kernel_ms_per_step']:.2f} ms in {out['kernels_per_step']:.0f} kernels, idle {out['gpu_idle_fraction']}",
          flush=True)
    return out


# ---- main ---------------------------------------------------------------------------------------

def report(result: dict) -> None:
    rows = [[r["dtype"], r["batch"], r["requests"], r["path"] + (f" (prefill {r['chunked_prefill_size']})" if r["path"] == "engine" else ""),
             r["tokens_per_s"], r["ttft_p50_s"], r["ttft_p90_s"], r.get("decode_steps"), r["peak_gib"]] for r in result["engine"]]
    if rows:
        print(table(["dtype", "B", "N", "path", "useful tok/s", "TTFT p50 s", "TTFT p90 s", "decode steps", "peak GiB"], rows))
    rows = [[p["dtype"], p["rows"], p["decode_step_ms"], p["forward_ms"], p["gpu_kernel_ms_per_step"], p["kernels_per_step"],
             p["gpu_idle_fraction"]] for p in result["profile"]]
    if rows:
        print(table(["dtype", "rows", "step ms", "forward ms", "GPU kernel ms", "kernels", "GPU idle"], rows))
    rows = [[g["engine_dtype"], g["recompute"], g["tokens"], g["gap_mean"], g["gap_max"], g["weight_outside_clip"], g["weight_above_cap"]]
            for g in result["logprobs"]]
    if rows:
        print(table(["engine", "recompute", "tokens", "mean |gap|", "max |gap|", "w outside 1±eps", "w > cap"], rows))
    rows = [[t["variant"], t["step_s"], t["real_tokens_per_s"], t["computed_tokens_per_s"], t["peak_gib"]] for t in result["train"] if "step_s" in t]
    if rows:
        print(table(["trainer variant", "step s", "real tok/s", "computed tok/s", "peak GiB"], rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_logs()
    torch.set_num_threads(min(4, torch.get_num_threads()))
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    label = args.name or f"{Path(str(args.model)).name}_{args.device.replace(':', '')}"
    result: dict = {"args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                    "machine": machine(torch.get_num_threads()), "engine": [], "profile": [], "logprobs": [], "train": []}
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30, "cuda": torch.version.cuda}
    print(f"model={args.model} random_weights={args.random_weights} device={args.device} {result.get('gpu', '')}", flush=True)
    started = time.perf_counter()
    result["errors"] = []

    def attempt(part: str, fn) -> None:
        # A part that fails is recorded and the others still run; the file is rewritten after each.
        try:
            fn()
        except Exception:
            print(traceback.format_exc(), flush=True)
            result["errors"].append({"part": part, "traceback": traceback.format_exc()[-4000:]})
        result["wall_s"] = time.perf_counter() - started
        path = write_result(f"gpu_path_{label}", result)
        if args.out:
            shutil.copy(path, Path(args.out) / path.name)

    if "logprobs" in args.parts:
        attempt("logprobs", lambda: result.__setitem__("logprobs", logprob_part(args, build)))
    for dtype in args.dtypes if {"engine", "profile"} & args.parts else []:
        attempt(f"engine {dtype}", lambda: engine_part(args, dtype, result))
    if {"train", "fsdp"} & args.parts:
        attempt("train", lambda: result.__setitem__("train", train_part(args, build)))
    report(result)
    print(f"wrote bench/results/gpu_path_{label}.json; errors: {len(result['errors'])}")


if __name__ == "__main__":
    main()
