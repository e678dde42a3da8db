"""Gateway overhead: the OpenAI gateway vs calling the engine directly, at 32 concurrent
streams.

What it measures
    One `flywheel.serve.loop.ServeLoop` (embedded engine, max_batch_size = concurrency, recording turns
    to a private nats-server) serves every mode, so the model, engine, threads and process are
    the same; only the path in front of the engine changes:

    - engine_http: C concurrent streaming SGLang `/generate` requests (prompt ids,
               incremental output, no logprobs: the gateway's client asks for none either)
               over loopback HTTP from a separate client process to the same engine's native
               server (`flywheel.serve.engine.server`, second port, same process and event loop):
               calling the engine directly, as a client of an SGLang server would;
    - gateway: C concurrent streaming `/v1/chat/completions` requests over loopback HTTP from
               the same kind of client process, which also pays for the chat template,
               tokenization, validation, asking the engine for logprobs, OpenAI chunk
               encoding and recording each turn on NATS;
    - direct:  C concurrent consumers of `engine.stream(prompt_ids, SamplingParams(...))` in
               the server's own event loop: no HTTP, no protocol layer and no load generator
               on the machine (a lower bound, not something a client can call);
    - native:  (`--modes` only) C concurrent `InProcessEngineClient.generate_stream(body)`,
               the protocol layer the gateway calls, in-process.

    The client process is httpx SSE by default; `--client raw`: hand-parsed HTTP/1.1 on an
    asyncio socket, the cheapest load generator; `--client openai` (gateway only): the
    official AsyncOpenAI client, with engine_http on httpx.

    Every stream has its own user message (seeded); the other modes get exactly the prompt
    ids the gateway renders from it (checked against a recorded turn), and the same sampling
    (max_new_tokens = `--max-tokens`, temperature 1, top_p 1, stream i seeded `--seed` * 1000
    + i in every mode and round, so the modes generate the same tokens). The gateway does not
    accept `ignore_eos`, so no mode uses it: outputs may end early at EOS and every figure is
    per token actually produced.

    Load (`--load`): `rounds` (default): a round is C requests started together, the next
    round starts when the last stream ended, its wall time runs from the start to that end;
    every request's admission (parsing, template, tokenization) happens in a burst and the
    slowest stream sets the round's time. `steady`: each of C streams sends its next request
    as soon as its previous one ended, for `--duration` seconds per block (closed loop, as
    serving benchmarks run at a fixed concurrency); the wall time runs from the first
    request's start to the last stream's end.

    Per mode: output tokens/s (tokens / summed walls), time per output token per stream
    (TPOT = (finish - first token) / (tokens - 1)) p50/p99, and time to first token (TTFT)
    p50/p99; and, to show where the time goes, the engine's wall time per decode step and the
    server threads' CPU time and context switches per token (event loop, engine thread, the
    rest: torch's intra-op pool etc.). Overhead = gateway vs engine_http: extra wall time per
    generated token (engine_http tok/s / gateway tok/s - 1) and TPOT p50 ratio - 1; target
    <= 5%; the same against direct is reported too. Modes run in blocks (of `--rounds` rounds
    or `--duration` seconds), rotated, `--blocks` times, after one warm-up round each. Each
    block first waits (up to 90 s) until other processes use under 0.25 cores, and the CPU
    they used during the block is recorded (the machine is shared; the client process's own
    CPU is counted as ours); a block during which they used more than `--max-noise` cores
    (0.3) is discarded and redone (up to `--attempts` times, the last one is kept).

How to run (from the repository root)
    .venv/bin/python bench/gateway_overhead.py                 # tiny, 32 streams x 64 tokens
    .venv/bin/python bench/gateway_overhead.py --model smollm2-135m --rounds 2 --blocks 3
    .venv/bin/python bench/gateway_overhead.py --load steady --client raw
    options: --model M --concurrency C --max-tokens K --load rounds|steady --rounds R
             --duration S --blocks N --threads T --client httpx|raw|openai --modes ...

    The server's torch uses `--threads` intra-op threads (serve.torch_threads, default 2).
    Writes bench/results/gateway_overhead_<model>[_openai|_raw][_steady][_t<threads> unless 2].json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    CpuWatch,
    machine,
    ms,
    percentile,
    quiet_logs,
    table,
    thread_delta,
    thread_times,
    tpot_s,
    ttft_s,
    wait_quiet_async,
    write_result,
)
from bench.lib.in_process_streams import (  # noqa: E402
    direct_stream,
    in_process_load,
    native_stream,
    steady_wall,
)
from bench.lib.served import ClientRun, Served  # noqa: E402
from bench.lib.workload import render, user_message  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--load", choices=["rounds", "steady"], default="rounds",
                   help="rounds: C requests started together, the next round when all ended; steady: each of C streams "
                        "sends its next request as soon as its last one ended")
    p.add_argument("--rounds", type=int, default=8, help="rounds per block (--load rounds)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per block (--load steady)")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="serve.torch_threads (default 2)")
    p.add_argument("--client", choices=["httpx", "openai", "raw"], default="httpx")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-noise", type=float, default=0.3, help="redo a block during which other processes used more cores")
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--modes", default="direct,engine_http,gateway",
                   help="comma-separated, of direct, native, engine_http, gateway (overhead needs engine_http and gateway)")
    return p.parse_args()


def summarize(records: list[dict], walls: list[float]) -> dict:
    """A path's figures over its timed (not warm-up) requests and the blocks' wall times."""
    timed = [r for r in records if r["tag"] != "warmup"]
    ok = [r for r in timed if r["done"] and not r["error"] and r["tokens"]]
    tokens = sum(r["tokens"] for r in ok)
    tpot = tpot_s(ok)
    ttft = ttft_s(ok)
    wall = sum(walls)
    return {
        "requests": len(timed), "failed": len(timed) - len(ok), "tokens": tokens,
        "mean_tokens_per_request": tokens / max(1, len(ok)),
        "finish_reasons": {k: sum(1 for r in ok if r["finish_reason"] == k) for k in {r["finish_reason"] for r in ok}},
        "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "tpot_mean_ms": ms(sum(tpot) / len(tpot)) if tpot else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "failures": [{k: r.get(k) for k in ("error", "finish_reason", "done")} for r in timed if r not in ok][:3],
    }


MODES = ("direct", "native", "engine_http", "gateway")


# ---- setup, and running the paths' blocks --------------------------------------------------

class PathRunner:
    """The paths in front of one served engine: each stream's conversation and the prompt ids the
    gateway renders from it, the client process's config per HTTP path, and every timed block's
    records, wall times and CPU per path (`results`)."""

    def __init__(self, served: Served, args: argparse.Namespace, modes: list[str]):
        from flywheel.serve.backends.in_process import InProcessEngineClient

        self.served, self.args, self.modes = served, args, modes
        self.seed = 1000 * args.seed
        self.engine = served.loop.engine
        rng = random.Random(args.seed)
        conversations = [[{"role": "user", "content": user_message(rng, args.prompt_words)}] for _ in range(args.concurrency)]
        self.prompts = [render(self.engine.tokenizer, c) for c in conversations]
        self.native = InProcessEngineClient(self.engine)
        self.client_cfg = {
            "gateway": {"url": served.url, "model": served.loop.model_name, "client": args.client, "messages": conversations},
            "engine_http": {"url": served.native_url, "protocol": "native", "prompts": self.prompts,
                            "client": "httpx" if args.client == "openai" else args.client},
        }
        self.thread_ids = {"event_loop": threading.main_thread().native_id, "engine": self.engine._thread.native_id}
        self.results: dict[str, dict] = {m: {"records": [], "walls": [], "cpu": [], "client_cpu_s": 0.0} for m in modes}

    async def warm_up(self) -> None:
        """One untimed round of each path; then the prompt-rendering threads exist and are named."""
        for mode in self.modes:
            await self.run_mode(mode, {"mode": "rounds", "rounds": 0, "warmup_rounds": 1})
        self.thread_ids.update({t.name: t.native_id for t in threading.enumerate() if t.name.startswith("prompts")})

    async def timed_blocks(self) -> None:
        """`--blocks` blocks of every path (`--rounds` rounds or `--duration` s each), the paths'
        order rotated by one each block."""
        args = self.args
        load = {"mode": "duration", "duration_s": args.duration} if args.load == "steady" else \
            {"mode": "rounds", "rounds": args.rounds, "warmup_rounds": 0}
        for block in range(args.blocks):
            order = self.modes[block % len(self.modes):] + self.modes[: block % len(self.modes)]
            for mode in order:
                await self.run_mode(mode, load)

    async def run_mode(self, mode: str, load: dict) -> None:
        """One block of `mode`, redone (up to `--attempts` in all) while other processes used more
        than `--max-noise` cores; its records, walls and CPU are added to `results`."""
        args = self.args
        timed = load["mode"] == "duration" or load["rounds"] > 0
        for attempt in range(1, args.attempts + 1):
            res, cpu, client_cpu = await self.run_block(mode, load, timed)
            if not timed or cpu["foreign_cores"] <= args.max_noise or attempt == args.attempts:
                break
            print(f"  {mode:11s} block discarded: other processes used {cpu['foreign_cores']:.2f} cores", flush=True)
        cpu["attempt"] = attempt
        results = self.results[mode]
        results["client_cpu_s"] += client_cpu
        results["records"] += [r for r in res["records"] if r["tag"] != "warmup"]
        results["walls"] += res["walls"]
        if timed:
            results["cpu"].append(cpu)
            s = summarize(res["records"], res["walls"])
            if s["failed"] == s["requests"]:
                raise RuntimeError(f"every {mode} request failed, e.g. {s['failures']}")
            print(f"  {mode:11s} {s['requests']:4d} requests: {s['tokens_per_s']:8.1f} tok/s  "
                  f"TPOT p50 {s['tpot_p50_ms']:6.2f} ms  TTFT p50 {s['ttft_p50_ms']:7.1f} ms  failed {s['failed']}  "
                  f"(other processes: {cpu['foreign_cores']:.2f} cores)", flush=True)

    async def run_block(self, mode: str, load: dict, timed: bool) -> tuple[dict, dict, float]:
        """One block of `mode`: ({"records", "walls"}, its CPU record with the server threads' CPU
        and the engine's decode steps, the client process's CPU seconds)."""
        quiet = await wait_quiet_async() if timed else {"waited_s": 0.0}
        threads0, steps0 = thread_times(), self.engine.stats["steps"]
        if mode in self.client_cfg:
            res, cpu, client_cpu = await self._client_block(mode, load)
        else:
            res, cpu, client_cpu = await self._in_process_block(mode, load)
        cpu["waited_for_quiet_s"] = quiet["waited_s"]
        cpu["threads"] = thread_delta(threads0, thread_times(), self.thread_ids)
        cpu["decode_steps"] = self.engine.stats["steps"] - steps0
        return res, cpu, client_cpu

    async def _client_block(self, mode: str, load: dict) -> tuple[dict, dict, float]:
        """An HTTP path (engine_http, gateway): the streams run in the client process."""
        args = self.args
        cfg = dict(self.client_cfg[mode], concurrency=args.concurrency, max_tokens=args.max_tokens, seed=self.seed, **load)
        out = await ClientRun(self.served.tmp, cfg).run()
        walls = [r["end"] - r["start"] for r in out["rounds"] if r["tag"] != "warmup"] if load["mode"] == "rounds" \
            else [steady_wall(out["records"])]
        return {"records": out["records"], "walls": walls}, out["cpu"], out["client_cpu_s"]

    async def _in_process_block(self, mode: str, load: dict) -> tuple[dict, dict, float]:
        """An in-process path (direct, native): the streams run in the server's event loop."""
        max_tokens = self.args.max_tokens
        make = (lambda ids, s, tag: direct_stream(self.engine, ids, max_tokens, s, tag)) if mode == "direct" else \
               (lambda ids, s, tag: native_stream(self.native, ids, max_tokens, s, tag))
        watch = CpuWatch().start()
        res = await in_process_load(make, self.prompts, self.seed, load)
        return res, watch.stop(), 0.0


async def recorded(served: Served, prompts: list[list[int]]) -> dict:
    """After the blocks: whether the last recorded turn's prompt ids are among the ones the other
    paths were given, and the gateway's turns published and dropped."""
    from flywheel.bus import TURN_SUBJECT

    await served.loop.recorder.flush(timeout_s=10)
    last_turn = await served.loop.bus.last(TURN_SUBJECT)
    stats = served.loop.stats()
    return {"prompt_ids_match": last_turn is not None and last_turn.prompt_ids in prompts,
            "published": stats["published"], "dropped": stats["dropped"]}


async def main_async(args: argparse.Namespace) -> None:
    modes = [m for m in MODES if m in args.modes.split(",")]
    overrides = [f"serve.max_batch_size={args.concurrency}", f"serve.torch_threads={args.threads}",
                 f"serve.max_new_tokens={max(1024, args.max_tokens)}"]
    async with Served(args.model, overrides, native="engine_http" in modes) as served:
        import torch

        runner = PathRunner(served, args, modes)
        prompts = runner.prompts
        print(f"model={args.model} streams={args.concurrency} max_tokens={args.max_tokens} "
              f"torch_threads={torch.get_num_threads()} client={args.client} "
              f"prompt tokens {min(map(len, prompts))}..{max(map(len, prompts))} url={served.url}", flush=True)
        await runner.warm_up()
        await runner.timed_blocks()
        turns = await recorded(served, prompts)

    summary = path_summary(runner.results, modes, runner.thread_ids, runner.client_cfg)
    print_tables(summary, args.concurrency)
    overheads = {base: overhead(summary[base], summary["gateway"]) for base in ("engine_http", "direct")
                 if {base, "gateway"} <= summary.keys()}
    if not overheads:
        return  # a run of one path (for profiling) has nothing to compare and keeps no JSON
    met = print_verdicts(summary, overheads, turns)
    path = save_result(args, summary, overheads, met, turns)
    print(f"wrote {path}")


# ---- analysis ------------------------------------------------------------------------------

def path_summary(results: dict[str, dict], modes: list[str], thread_ids: dict[str, int], client_cfg: dict) -> dict:
    """Per path: `summarize` of its timed blocks, plus wall time per decode step, the server
    threads' CPU and context switches per token, the front's CPU against the engine's, the
    client process's CPU per token and the other processes' mean load."""
    summary = {m: summarize(results[m]["records"], results[m]["walls"]) for m in modes}
    for m in summary:
        blocks = results[m]["cpu"]
        tokens = summary[m]["tokens"]
        steps = sum(b["decode_steps"] for b in blocks)
        summary[m]["decode_steps"] = steps
        summary[m]["ms_per_decode_step"] = 1e3 * summary[m]["wall_s"] / steps if steps else None
        summary[m]["threads_us_per_token"] = {
            name: {k: (1e6 if k == "cpu_s" else 1.0) * sum(b["threads"][name][k] for b in blocks) / tokens
                   for k in ("cpu_s", "voluntary_switches", "involuntary_switches")}
            for name in ("event_loop", "engine", "other", *(n for n in thread_ids if n.startswith("prompts")))
        }
        summary[m]["cpu_share"] = cpu_share(summary[m]["threads_us_per_token"])
        summary[m]["client_us_per_token"] = 1e6 * results[m]["client_cpu_s"] / tokens if m in client_cfg else None
        summary[m]["foreign_cores_mean"] = sum(c["foreign_cores"] for c in blocks) / len(blocks)
        summary[m]["cpu_blocks"] = blocks
    return summary


def cpu_share(per_token: dict) -> dict:
    """CPU per token of the front (the event loop, which parses, validates, streams and records,
    and the prompt-rendering thread) against the engine's (its thread and torch's intra-op
    threads, "other": nothing else in the process does steady work)."""
    front = per_token["event_loop"]["cpu_s"] + sum(v["cpu_s"] for k, v in per_token.items() if k.startswith("prompts"))
    engine = per_token["engine"]["cpu_s"] + per_token["other"]["cpu_s"]
    return {"front_us": front, "engine_us": engine, "ratio": front / engine}


def overhead(base: dict, gateway: dict) -> dict:
    """The gateway's extra wall time per token and its TPOT p50 ratio - 1, against `base`."""
    return {"tokens_per_s": base["tokens_per_s"] / gateway["tokens_per_s"] - 1,
            "tpot_p50": gateway["tpot_p50_ms"] / base["tpot_p50_ms"] - 1}


# ---- report --------------------------------------------------------------------------------

def print_tables(summary: dict, concurrency: int) -> None:
    """Per path: throughput and latency; then where the time and CPU go."""
    print()
    print(table(["path", "requests", "failed", "tokens/req", "tok/s", "wall ms/token/stream", "TPOT p50 ms", "TPOT p99 ms",
                 "TTFT p50 ms", "TTFT p99 ms", "other procs (cores)"],
                [[m, s["requests"], s["failed"], s["mean_tokens_per_request"], s["tokens_per_s"],
                  1e3 / s["tokens_per_s"] * concurrency, s["tpot_p50_ms"], s["tpot_p99_ms"], s["ttft_p50_ms"], s["ttft_p99_ms"],
                  s["foreign_cores_mean"]] for m, s in summary.items()]))
    print()
    rows = []
    for m, s in summary.items():
        t = s["threads_us_per_token"]
        rows.append([m, s["ms_per_decode_step"], t["event_loop"]["cpu_s"], t["engine"]["cpu_s"], t["other"]["cpu_s"],
                     s["client_us_per_token"],
                     t["event_loop"]["voluntary_switches"] + t["event_loop"]["involuntary_switches"],
                     t["engine"]["voluntary_switches"] + t["engine"]["involuntary_switches"]])
    print(table(["path", "wall ms per decode step", "event-loop CPU us/token", "engine-thread CPU us/token",
                 "other threads CPU us/token", "client CPU us/token", "event-loop ctx switches/token",
                 "engine ctx switches/token"], rows))


def print_verdicts(summary: dict, overheads: dict[str, dict], turns: dict) -> bool:
    """The gateway's overhead against each baseline, each path's front/engine CPU, the target
    (gateway vs engine_http <= 5 % on both figures) and the recording check. -> target met."""
    print()
    for base, o in overheads.items():
        print(f"gateway vs {base}: {100 * o['tokens_per_s']:+.1f}% wall time per token (tok/s), "
              f"{100 * o['tpot_p50']:+.1f}% TPOT p50")
    for m, s in summary.items():
        share = s["cpu_share"]
        print(f"{m}: front (event loop + prompt thread) {share['front_us']:.0f} us/token = {100 * share['ratio']:.1f}% of the "
              f"engine's {share['engine_us']:.0f} us/token (engine thread + torch threads)")
    met = "engine_http" in overheads and max(overheads["engine_http"].values()) <= 0.05
    verdict = "MET" if met else "MISSED" if "engine_http" in overheads else "not measured"
    print(f"target (gateway vs engine_http) <= 5%: {verdict}")
    print(f"turns published {turns['published']}, dropped {turns['dropped']}; recorded prompt ids match the other modes': "
          f"{turns['prompt_ids_match']}")
    return met


def save_result(args: argparse.Namespace, summary: dict, overheads: dict[str, dict], met: bool, turns: dict) -> Path:
    """bench/results/gateway_overhead_<model>[_openai|_raw][_steady][_t<threads>].json."""
    name = (f"gateway_overhead_{args.model}" + ("" if args.client == "httpx" else f"_{args.client}")
            + ("" if args.load == "rounds" else f"_{args.load}") + ("" if args.threads == 2 else f"_t{args.threads}"))
    return write_result(name, {
        "model": args.model, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "load": args.load,
        "rounds_per_block": args.rounds if args.load == "rounds" else None,
        "seconds_per_block": args.duration if args.load == "steady" else None,
        "blocks": args.blocks, "client": args.client, "seed": args.seed, "machine": machine(args.threads),
        "summary": summary, "overheads": overheads, "target": 0.05, "target_met": met,
        "turns_published": turns["published"], "turns_dropped": turns["dropped"], "prompt_ids_match": turns["prompt_ids_match"],
    })


def main() -> None:
    args = parse_args()
    quiet_logs()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
