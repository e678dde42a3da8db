"""Hot swap cost: what publishing new weights every ~second does to a gateway under load.

What it measures
    One `flywheel.serve.loop.ServeLoop` (embedded engine, `serve.swap_mode` in_place, turns recorded to
    a private nats-server) serves K streaming chat clients that each send one request after
    another (a separate client process, httpx SSE, `logprobs: true` so that every output token
    arrives in a chunk of its own with its `system_fingerprint` version). Two phases of the same
    length, after a short warm-up:

    - baseline: no swaps;
    - swaps:    a second bus connection (standing in for the trainer) announces S new
                versions on `flywheel.weights` (`bus.WeightUpdate`) every `--interval` s. The
                versions are written with `models.WeightStore(...).publish(model, v)` (each
                slightly different) just before the phase, untimed, by a child process: in a
                deployment the trainer writes them in its own process; writing SmolLM2 (0.5 GB)
                inside the server process would measure the writer, and torch work on a second
                thread of the server process slows its engine thread down for good (see
                docs/benchmarks.md, "Odd things" 1).

    Each phase first waits (up to 90 s) until other processes use under 0.25 cores; a phase
    during which they used more than `--max-noise` cores (0.3) is redone once (`--attempts`;
    a redone swap phase announces fresh versions). Discarded phases still count for (c), (d).

    Reported:
    (a) per swap: how long the engine stood still (its pause command to its resume, timed in
        the engine thread by wrapping the instance's `_do_pause`/`_do_resume`/`_do_update`),
        the load itself, `ServeLoop.pauses` (the pool's view, pause..resume round trip), the
        announcement-to-live delay, and the largest client-side gap between two tokens of
        any stream that overlaps the stall; baseline gaps for comparison;
    (b) time per output token per request (TPOT) p50/p99, inter-token gap p50/p99/max and
        output tokens/s, without and with swaps (a gap is the time between two consecutive
        chunks carrying tokens: one token each, unless the engine coalesced a backlog);
    (c) failed or aborted requests (HTTP errors, error events, streams without [DONE], finish
        reason not stop/length, engine aborts), which must be 0;
    (d) versions: every recorded turn on NATS has non-decreasing `output_versions` drawn only
        from {0} and the published versions; each chunk's fingerprint version (the version of
        its last token) equals the turn's `output_versions` there, and the chunks' token counts
        add up to the turn's; no token carries a version before that version
        finished loading; and how many turns span a swap.

How to run (from the repository root)
    .venv/bin/python bench/hot_swap.py                        # tiny: 32 clients, 10 swaps, 1 s apart
    .venv/bin/python bench/hot_swap.py --model smollm2-135m   # 8 clients
    options: --concurrency K --max-tokens N --swaps S --interval SEC --threads T

    The server's torch uses `--threads` intra-op threads (serve.torch_threads, default 2).
    Writes bench/results/hot_swap_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    machine,
    percentile,
    quiet_logs,
    table,
    wait_quiet_async,
    write_result,
)
from bench.lib.hot_swap_analysis import analyse, phase_stats  # noqa: E402
from bench.lib.served import ClientRun, Served  # noqa: E402
from bench.lib.workload import user_message  # noqa: E402

DEFAULTS = {"tiny": {"concurrency": 32, "max_tokens": 64}, "smollm2-135m": {"concurrency": 8, "max_tokens": 48}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--lead", type=float, default=2.0, help="seconds of the swap phase before the first announcement")
    p.add_argument("--threads", type=int, default=2, help="serve.torch_threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-noise", type=float, default=0.3, help="redo a phase during which other processes used more cores")
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--writer", help=argparse.SUPPRESS)  # internal: write versions into this store and exit
    p.add_argument("--first", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--keep", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    base = DEFAULTS.get(args.model, DEFAULTS["smollm2-135m"])
    args.concurrency = args.concurrency or base["concurrency"]
    args.max_tokens = args.max_tokens or base["max_tokens"]
    args.phase_s = args.lead + args.swaps * args.interval + 1.0
    return args


class GcLog:
    """Garbage-collection passes of the server process that took at least 5 ms."""

    def __init__(self):
        self.passes: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.monotonic()
        elif time.monotonic() - self._started >= 0.005:
            self.passes.append((self._started, time.monotonic() - self._started, info["generation"]))


class EngineTimeline:
    """Times of pause / load / resume as the engine thread executes them (instance wrappers)."""

    def __init__(self, engine):
        self.events: list[tuple] = []
        pause, resume, update = engine._do_pause, engine._do_resume, engine._do_update

        def do_pause(mode):
            self.events.append(("pause", time.monotonic()))
            return pause(mode)

        def do_resume():
            out = resume()
            self.events.append(("resume", time.monotonic()))
            return out

        def do_update(path, version, abort_all):
            started = time.monotonic()
            out = update(path, version, abort_all)
            self.events.append(("update", time.monotonic(), int(version), started))
            return out

        engine._do_pause, engine._do_resume, engine._do_update = do_pause, do_resume, do_update

    def swaps(self) -> list[dict]:
        """One entry per loaded version: pause, load start/end, resume."""
        out, pause_at = [], None
        for event in self.events:
            if event[0] == "pause":
                pause_at = event[1]
            elif event[0] == "update":
                out.append({"version": event[2], "pause": pause_at, "load_start": event[3], "load_end": event[1], "resume": None})
            elif event[0] == "resume" and out and out[-1]["resume"] is None:
                out[-1]["resume"] = event[1]
        return out


# ---- setup ---------------------------------------------------------------------------------

class VersionWriter:
    """The versions the swap phase announces, written before it, untimed, by a child process
    standing in for the trainer (see the docstring). `await write()` -> the new versions."""

    def __init__(self, store_dir: Path, args: argparse.Namespace):
        from flywheel.models import WeightStore

        self.store_dir = store_dir
        self.store = WeightStore(store_dir, keep=args.swaps * args.attempts + 1)
        self.model, self.swaps = args.model, args.swaps
        self.write_s: list[float] = []  # seconds each version took to write
        self.published: set[int] = set()

    async def write(self) -> list[int]:
        first = len(self.published) + 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--writer", str(self.store_dir), "--model", self.model, "--first", str(first),
            "--swaps", str(self.swaps), "--keep", str(self.store.keep), stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError("the weight writer failed")
        self.write_s.extend(json.loads(out.decode().strip().splitlines()[-1]))
        versions = list(range(first, first + self.swaps))
        self.published.update(versions)
        return versions


def client_config(served: Served, args: argparse.Namespace) -> dict:
    """The client process's load: K streams (one seeded user message each) sending one request
    after another, with logprobs (a chunk per token, carrying its version's fingerprint)."""
    rng = random.Random(args.seed)
    conversations = [[{"role": "user", "content": user_message(rng, args.prompt_words)}] for _ in range(args.concurrency)]
    return {"url": served.url, "model": served.loop.model_name, "client": "httpx", "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "messages": conversations, "logprobs": True, "mode": "duration"}


# ---- the timed phases: baseline (no swaps), then swaps -------------------------------------

async def announce(nats_url: str, store, versions: list[int], args: argparse.Namespace) -> dict[int, float]:
    """The trainer's side of the swap phase, on a bus connection of its own: after `--lead` s,
    one version announced on `flywheel.weights` every `--interval` s. -> {version: when}."""
    from flywheel.bus import WEIGHTS_SUBJECT, Bus, WeightUpdate

    announced = {}
    trainer = await Bus.connect(nats_url, name="bench-trainer")
    await asyncio.sleep(args.lead)
    for v in versions:
        at = time.monotonic()
        await trainer.publish(WEIGHTS_SUBJECT, WeightUpdate(id=uuid.uuid4().hex, version=v, path=str(store.path(v)), step=v))
        announced[v] = at
        await asyncio.sleep(max(0.0, at + args.interval - time.monotonic()))
    await trainer.close()
    return announced


async def run_phase(served: Served, client_cfg: dict, writer: VersionWriter, versions: list[int],
                    args: argparse.Namespace) -> dict:
    """One phase: the clients for `phase_s` seconds while `versions` are announced (none: the
    baseline); then up to 60 s for every published version to be applied."""
    quiet = await wait_quiet_async()
    client = ClientRun(served.tmp, dict(client_cfg, duration_s=args.phase_s))
    await client.start()
    await client.go()
    t0 = time.monotonic()
    announced = await announce(served.nats_url, writer.store, versions, args) if versions else {}
    out = await client.finish()
    deadline = time.monotonic() + 60
    while served.loop.swaps < len(writer.published) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return {"t0": t0, "records": out["records"], "cpu": out["cpu"], "announced": announced, "versions": versions,
            "quiet": quiet, "client_cpu_s": out["client_cpu_s"]}


async def timed_phase(name: str, served: Served, client_cfg: dict, writer: VersionWriter, args: argparse.Namespace,
                      discarded: list[dict]) -> dict:
    """The `baseline` or the `swaps` phase, redone (up to `--attempts` in all) while other
    processes used more than `--max-noise` cores; a redone swap phase announces fresh versions.
    The phases given up on are appended to `discarded`."""
    for attempt in range(1, args.attempts + 1):
        versions = await writer.write() if name == "swaps" else []
        phase = await run_phase(served, client_cfg, writer, versions, args)
        phase["attempt"] = attempt
        s = phase_stats(phase["records"], phase["t0"])
        foreign = phase["cpu"]["foreign_cores"]
        print(f"  {name:8s}: {s['ok']} requests ok, {s['failed']} failed, {s['tokens_per_s']:.0f} tok/s, "
              f"TPOT p50 {s['tpot_p50_ms'] or float('nan'):.1f} ms, max gap {s['gap_max_ms'] or float('nan'):.0f} ms "
              f"(other processes: {foreign:.2f} cores)", flush=True)
        if foreign <= args.max_noise or attempt == args.attempts:
            break
        print(f"  {name:8s}: discarded (other processes used {foreign:.2f} cores), again", flush=True)
        discarded.append(dict(phase, name=name))
    return phase


async def server_side(loop, stats_before: dict) -> dict:
    """After the phases, from the server: every recorded turn (read back from the bus), the
    pool's pauses, the swaps applied, the engine's aborts since `stats_before`, the recorder."""
    from flywheel.bus import TURN_SUBJECT

    await loop.recorder.flush(timeout_s=30)
    stats_after = dict(loop.engine.stats)
    consumer = loop.bus.consumer(TURN_SUBJECT, durable="bench-hot-swap")
    turns, empty = {}, 0
    while empty < 2:
        batch = await consumer.fetch(512, timeout_s=1.0)
        empty = empty + 1 if not batch else 0
        for d in batch:
            turns[d.record.id] = d.record
            await d.ack()
    recorder = {"published": loop.recorder.published, "dropped": loop.recorder.dropped, "spilled": loop.recorder.spilled}
    return {"turns": turns, "pauses": list(loop.pauses), "swaps": loop.swaps,
            "engine_aborted": stats_after["aborted"] - stats_before["aborted"], "recorder": recorder}


# ---- report --------------------------------------------------------------------------------

def print_report(phases: dict[str, dict], server: dict, published: set[int], result: dict) -> None:
    """The per-swap and per-phase tables, then the verdicts: swap cost, TPOT, failures, versions."""
    per_swap, base, swap, versions = result["per_swap"], result["baseline"], result["with_swaps"], result["versions"]
    stalls = [p["engine_stall_ms"] for p in per_swap if p["engine_stall_ms"] is not None]
    loads = [p["load_ms"] for p in per_swap]
    near_gaps = [p["max_client_gap_ms"] for p in per_swap if p["max_client_gap_ms"] is not None]
    print()
    print(table(["swap to", "engine stall ms", "load ms", "ServeLoop.pauses ms", "announce->live ms", "max client gap ms"],
                [[p["version"], p["engine_stall_ms"], p["load_ms"], p["pool_pause_ms"], p["announce_to_live_ms"],
                  p["max_client_gap_ms"]] for p in per_swap]))
    print()
    print(table(["phase", "requests", "failed", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "gap p50 ms", "gap p99 ms",
                 "gap max ms", "TTFT p50 ms", "TTFT p99 ms", "other procs (cores)"],
                [[n, s["requests"], s["failed"], s["tokens_per_s"], s["tpot_p50_ms"], s["tpot_p99_ms"], s["gap_p50_ms"],
                  s["gap_p99_ms"], s["gap_max_ms"], s["ttft_p50_ms"], s["ttft_p99_ms"], phases[n]["cpu"]["foreign_cores"]]
                 for n, s in (("baseline", base), ("swaps", swap))]))
    print(f"\nswaps applied {server['swaps']}/{len(published)}; engine stall per swap: median {percentile(stalls, 50):.1f} ms, "
          f"max {max(stalls):.1f} ms (load median {percentile(loads, 50):.1f} ms); max client gap around a swap "
          f"{max(near_gaps) if near_gaps else float('nan'):.0f} ms vs {base['gap_max_ms']:.0f} ms max gap without swaps")
    first_swap = result["first_swap"]
    if first_swap:
        print(f"first swap of this server (v{first_swap['version']}, the first write into the loaded model's weights): "
              f"engine stall {first_swap['engine_stall_ms']:.0f} ms, load {first_swap['load_ms']:.0f} ms")
    print(f"TPOT p50 {base['tpot_p50_ms']:.1f} -> {swap['tpot_p50_ms']:.1f} ms "
          f"({100 * (swap['tpot_p50_ms'] / base['tpot_p50_ms'] - 1):+.1f}%), "
          f"p99 {base['tpot_p99_ms']:.1f} -> {swap['tpot_p99_ms']:.1f} ms "
          f"({100 * (swap['tpot_p99_ms'] / base['tpot_p99_ms'] - 1):+.1f}%)")
    failures = result["failures"]
    print(f"failed/aborted: {failures} (client failures {result['client_failures']}, engine aborts {server['engine_aborted']}, "
          f"aborted turns {result['aborted_turns']}) -> {'OK' if failures == 0 else 'FAIL'}")
    print(f"versions: {versions['turns']} turns on NATS for {result['timed_requests']} timed requests "
          f"(+ warm-up, incl. discarded phases); {versions['spanning_a_swap']} span a swap; "
          f"non-decreasing violations {versions['non_decreasing_violations']}, "
          f"unpublished versions {versions['unpublished_versions']}, "
          f"client/turn mismatches {versions['client_turn_mismatches']}, turns missing {versions['turns_missing']}, "
          f"tokens labelled before their version loaded {versions['tokens_before_load']} -> "
          f"{'OK' if versions['ok'] else 'FAIL'}")


def save_result(args: argparse.Namespace, phases: dict[str, dict], discarded: list[dict], writer: VersionWriter, server: dict,
                gc_passes: list[tuple[float, float, int]], result: dict) -> Path:
    """bench/results/hot_swap_<model>.json: the settings, every figure of the report, the raw
    per-swap and per-phase records behind them."""
    return write_result(f"hot_swap_{args.model}", {
        "model": args.model, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "swaps": args.swaps,
        "interval_s": args.interval, "phase_s": args.phase_s, "seed": args.seed, "machine": machine(args.threads),
        "store_write_s": writer.write_s, "per_swap": result["per_swap"], "first_swap": result["first_swap"],
        "serve_pauses_s": server["pauses"], "swaps_applied": server["swaps"],
        "versions_published": len(writer.published), "attempts": {n: phases[n]["attempt"] for n in phases},
        "discarded_phases": [{"name": d["name"], "cpu": d["cpu"]} for d in discarded],
        "baseline": result["baseline"], "with_swaps": result["with_swaps"],
        "server_gc_passes_over_5ms": [{"at_s": t - phases["baseline"]["t0"], "ms": 1e3 * d, "generation": gen}
                                      for t, d, gen in gc_passes],
        "largest_gaps": result["largest_gaps"],
        "cpu": {n: phases[n]["cpu"] for n in phases}, "waited_for_quiet": {n: phases[n]["quiet"] for n in phases},
        "client_cpu_s": {n: phases[n]["client_cpu_s"] for n in phases},
        "failures": result["failures"], "engine_aborted": server["engine_aborted"], "aborted_turns": result["aborted_turns"],
        "versions": result["versions"],
        "recorder": server["recorder"],
    })


async def main_async(args: argparse.Namespace) -> None:
    import torch

    overrides = [f"serve.max_batch_size={max(32, args.concurrency)}", f"serve.torch_threads={args.threads}"]
    async with Served(args.model, overrides) as served:
        timeline = EngineTimeline(served.loop.engine)
        gc_log = GcLog()
        writer = VersionWriter(served.tmp / "weights", args)
        client_cfg = client_config(served, args)
        print(f"model={args.model} clients={args.concurrency} max_tokens={args.max_tokens} swaps={args.swaps} every "
              f"{args.interval}s torch_threads={torch.get_num_threads()} phase={args.phase_s:.0f}s", flush=True)

        await ClientRun(served.tmp, dict(client_cfg, duration_s=2.0)).run()  # warm-up
        stats_before = dict(served.loop.engine.stats)
        phases: dict[str, dict] = {}
        discarded: list[dict] = []
        for name in ("baseline", "swaps"):
            phases[name] = await timed_phase(name, served, client_cfg, writer, args, discarded)
        server = await server_side(served.loop, stats_before)

    result = analyse(phases, discarded, timeline.swaps(), server, writer.published, gc_log.passes)
    print_report(phases, server, writer.published, result)
    path = save_result(args, phases, discarded, writer, server, gc_log.passes, result)
    print(f"wrote {path}")


def write_versions_main(args: argparse.Namespace) -> None:
    """The trainer stand-in: publish versions first..first+swaps-1 (each a little different) to
    the store, print the seconds each write took as JSON."""
    quiet_logs()
    import torch

    from flywheel.models import WeightStore, load_model

    model, _ = load_model(args.model)
    store = WeightStore(Path(args.writer), keep=args.keep)
    norm = model.model.norm.weight
    seconds = []
    for v in range(args.first, args.first + args.swaps):
        with torch.no_grad():
            norm.mul_(1.0 + 1e-3 * v)
        started = time.monotonic()
        store.publish(model, v)
        seconds.append(time.monotonic() - started)
    print(json.dumps(seconds), flush=True)


def main() -> None:
    args = parse_args()
    if args.writer:
        write_versions_main(args)
        return
    quiet_logs()
    logging.getLogger("flywheel.serve.engine.core").setLevel(logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
