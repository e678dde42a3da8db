"""Hot swap cost: what publishing new weights every ~second does to a gateway under load.

What it measures
    One `serve.loop.ServeLoop` (embedded engine, `serve.swap_mode` in_place, turns recorded to
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
                docs/benchmarks.md).

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
import itertools
import json
import logging
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import CpuWatch, machine, percentile, quiet_logs, table, wait_quiet_async, write_result  # noqa: E402
from bench._serve import ClientRun, Served  # noqa: E402
from bench.workload import user_message  # noqa: E402

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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def phase_stats(records: list[dict], t0: float) -> dict:
    ok = [r for r in records if r["done"] and not r["error"] and r["finish_reason"] in ("stop", "length") and r["tokens"]]
    failed = [r for r in records if r not in ok]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["t_finish"] - r["t_first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and r["t_first"]]
    gaps = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    ttft = [r["t_first"] - r["t_send"] for r in ok if r["t_first"]]
    end = max(((r["t_finish"] or r["t_send"]) for r in records), default=t0)
    wall = max(end - t0, 1e-9)
    return {
        "requests": len(records), "ok": len(ok), "failed": len(failed),
        "failures": [{k: r[k] for k in ("error", "finish_reason", "done")} for r in failed[:5]],
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "gap_p50_ms": _ms(percentile(gaps, 50)), "gap_p99_ms": _ms(percentile(gaps, 99)), "gap_max_ms": _ms(max(gaps, default=None)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
    }


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


async def main_async(args: argparse.Namespace) -> None:
    import torch

    from bus import TURN_SUBJECT, WEIGHTS_SUBJECT, Bus, WeightUpdate
    from models import WeightStore

    overrides = [f"serve.max_batch_size={max(32, args.concurrency)}", f"serve.torch_threads={args.threads}"]
    async with Served(args.model, overrides) as served:
        loop, engine = served.loop, served.loop.engine
        timeline = EngineTimeline(engine)
        gc_log = GcLog()

        # The versions to announce are written before each swap phase, untimed, by a separate
        # process standing in for the trainer (see the docstring).
        store_dir = served.tmp / "weights"
        store = WeightStore(store_dir, keep=args.swaps * args.attempts + 1)
        write_s: list[float] = []
        published: set[int] = set()

        async def write_versions() -> list[int]:
            first = len(published) + 1
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--writer", str(store_dir), "--model", args.model, "--first", str(first),
                "--swaps", str(args.swaps), "--keep", str(store.keep), stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError("the weight writer failed")
            write_s.extend(json.loads(out.decode().strip().splitlines()[-1]))
            versions = list(range(first, first + args.swaps))
            published.update(versions)
            return versions

        rng = random.Random(args.seed)
        conversations = [[{"role": "user", "content": user_message(rng, args.prompt_words)}] for _ in range(args.concurrency)]
        client_cfg = {"url": served.url, "model": loop.model_name, "client": "httpx", "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "messages": conversations, "logprobs": True, "mode": "duration"}
        print(f"model={args.model} clients={args.concurrency} max_tokens={args.max_tokens} swaps={args.swaps} every "
              f"{args.interval}s torch_threads={torch.get_num_threads()} phase={args.phase_s:.0f}s", flush=True)

        await ClientRun(served.tmp, dict(client_cfg, duration_s=2.0)).run()  # warm-up
        stats0 = dict(engine.stats)

        phases: dict[str, dict] = {}
        discarded: list[dict] = []
        for name in ("baseline", "swaps"):
            for attempt in range(1, args.attempts + 1):
                versions = await write_versions() if name == "swaps" else []
                quiet = await wait_quiet_async()
                client = ClientRun(served.tmp, dict(client_cfg, duration_s=args.phase_s))
                await client.start()
                await client.go()
                t0 = time.monotonic()
                announced = {}
                if versions:
                    trainer = await Bus.connect(served.nats_url, name="bench-trainer")
                    await asyncio.sleep(args.lead)
                    for v in versions:
                        at = time.monotonic()
                        await trainer.publish(WEIGHTS_SUBJECT, WeightUpdate(id=uuid.uuid4().hex, version=v, path=str(store.path(v)), step=v))
                        announced[v] = at
                        await asyncio.sleep(max(0.0, at + args.interval - time.monotonic()))
                    await trainer.close()
                out = await client.finish()
                deadline = time.monotonic() + 60
                while loop.swaps < len(published) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                phase = {"t0": t0, "records": out["records"], "cpu": out["cpu"], "announced": announced, "versions": versions,
                         "quiet": quiet, "client_cpu_s": out["client_cpu_s"], "attempt": attempt}
                s = phase_stats(out["records"], t0)
                print(f"  {name:8s}: {s['ok']} requests ok, {s['failed']} failed, {s['tokens_per_s']:.0f} tok/s, "
                      f"TPOT p50 {s['tpot_p50_ms'] or float('nan'):.1f} ms, max gap {s['gap_max_ms'] or float('nan'):.0f} ms "
                      f"(other processes: {out['cpu']['foreign_cores']:.2f} cores)", flush=True)
                if out["cpu"]["foreign_cores"] <= args.max_noise or attempt == args.attempts:
                    break
                print(f"  {name:8s}: discarded (other processes used {out['cpu']['foreign_cores']:.2f} cores), again", flush=True)
                discarded.append(dict(phase, name=name))
            phases[name] = phase

        await loop.recorder.flush(timeout_s=30)
        stats1 = dict(engine.stats)
        # Every recorded turn, from the bus.
        consumer = loop.bus.consumer(TURN_SUBJECT, durable="bench-hot-swap")
        turns, empty = {}, 0
        while empty < 2:
            batch = await consumer.fetch(512, timeout_s=1.0)
            empty = empty + 1 if not batch else 0
            for d in batch:
                turns[d.record.id] = d.record
                await d.ack()
        serve_pauses = list(loop.pauses)
        serve_swaps = loop.swaps
        recorder = {"published": loop.recorder.published, "dropped": loop.recorder.dropped, "spilled": loop.recorder.spilled}

    # ---- analysis ------------------------------------------------------------------------
    base = phase_stats(phases["baseline"]["records"], phases["baseline"]["t0"])
    swap = phase_stats(phases["swaps"]["records"], phases["swaps"]["t0"])
    all_swaps = timeline.swaps()
    pause_of = {s["version"]: p for s, p in zip(all_swaps, serve_pauses)}
    swaps = [s for s in all_swaps if s["version"] in phases["swaps"]["versions"]]
    records = phases["swaps"]["records"]
    gaps = [(a, b) for r in records for a, b in zip(r["chunks"], r["chunks"][1:])]
    per_swap = []
    for s in swaps:
        stall = s["resume"] - s["pause"] if s["resume"] and s["pause"] else None
        near = [b - a for a, b in gaps if s["pause"] and a <= (s["resume"] or s["load_end"]) and b >= s["pause"]]
        announced = phases["swaps"]["announced"].get(s["version"])
        per_swap.append({
            "version": s["version"], "engine_stall_ms": 1e3 * stall if stall is not None else None,
            "load_ms": 1e3 * (s["load_end"] - s["load_start"]),
            "pool_pause_ms": 1e3 * pause_of[s["version"]] if s["version"] in pause_of else None,
            "announce_to_live_ms": 1e3 * (s["resume"] - announced) if announced and s["resume"] else None,
            "max_client_gap_ms": 1e3 * max(near) if near else None,
        })
    loaded_at = {s["version"]: s["load_end"] for s in all_swaps}
    pauses_at = [s["pause"] for s in swaps if s["pause"]]

    def largest_gaps(phase: dict) -> list[dict]:
        """The 5 largest inter-token gaps of a phase: when (s into the phase), how long, and how
        far the nearest swap's pause was from the gap's start."""
        found = sorted(((b - a, a) for r in phase["records"] for a, b in zip(r["chunks"], r["chunks"][1:])), reverse=True)[:5]
        return [{"gap_ms": 1e3 * g, "at_s": a - phase["t0"],
                 "nearest_swap_pause_s": min((p - a for p in pauses_at), key=abs) if pauses_at and phase is phases["swaps"] else None,
                 "server_gc_ms_inside": 1e3 * sum(d for t, d, _ in gc_log.passes if a <= t <= a + g)}
                for g, a in found]

    # Version checks: the bus's turns, and each client's per-token fingerprints against them.
    allowed = {0} | published
    bad_order = [t.id for t in turns.values() if any(b < a for a, b in zip(t.output_versions, t.output_versions[1:]))]
    bad_value = [t.id for t in turns.values() if not set(t.output_versions) <= allowed]
    spanning = sum(1 for t in turns.values() if len(set(t.output_versions)) > 1)
    aborted_turns = sum(1 for t in turns.values() if t.finish_reason == "abort")
    all_records = [r for ph in [*phases.values(), *discarded] for r in ph["records"]]
    by_turn_id = {f"{r['id'].removeprefix('chatcmpl-')}-0": r for r in all_records if r.get("id")}
    mismatched = missing = early = 0
    mismatch_examples: list[dict] = []
    for turn_id, r in by_turn_id.items():
        turn = turns.get(turn_id)
        if turn is None:
            missing += 1
            continue
        # A chunk's fingerprint is the version of its last token (a chunk may carry several
        # tokens when the engine coalesced a backlog): compare each with the recorded turn.
        ends = list(itertools.accumulate(r["n"]))
        recorded = list(turn.output_versions)
        if len(r["versions"]) != len(ends) or (ends and ends[-1] != len(recorded)) or any(
                v != recorded[end - 1] for v, end in zip(r["versions"], ends)):
            mismatched += 1
            if len(mismatch_examples) < 3:
                mismatch_examples.append({"turn": turn_id, "client_versions": r["versions"], "client_n": r["n"],
                                          "turn_versions": recorded, "finish": turn.finish_reason})
        early += sum(1 for t, v in zip(r["chunks"], r["versions"]) if v > 0 and (v not in loaded_at or t < loaded_at[v]))
    versions_ok = not bad_order and not bad_value and not mismatched and not missing and not early
    engine_aborted = stats1["aborted"] - stats0["aborted"]
    client_failures = sum(phase_stats(ph["records"], ph["t0"])["failed"] for ph in [*phases.values(), *discarded])
    failures = client_failures + engine_aborted + aborted_turns

    stalls = [p["engine_stall_ms"] for p in per_swap if p["engine_stall_ms"] is not None]
    loads = [p["load_ms"] for p in per_swap]
    near_gaps = [p["max_client_gap_ms"] for p in per_swap if p["max_client_gap_ms"] is not None]
    print()
    print(table(["swap to", "engine stall ms", "load ms", "ServeLoop.pauses ms", "announce->live ms", "max client gap ms"],
                [[p["version"], p["engine_stall_ms"], p["load_ms"], p["pool_pause_ms"], p["announce_to_live_ms"], p["max_client_gap_ms"]]
                 for p in per_swap]))
    print()
    print(table(["phase", "requests", "failed", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "gap p50 ms", "gap p99 ms",
                 "gap max ms", "TTFT p50 ms", "TTFT p99 ms", "other procs (cores)"],
                [[n, s["requests"], s["failed"], s["tokens_per_s"], s["tpot_p50_ms"], s["tpot_p99_ms"], s["gap_p50_ms"],
                  s["gap_p99_ms"], s["gap_max_ms"], s["ttft_p50_ms"], s["ttft_p99_ms"], phases[n]["cpu"]["foreign_cores"]]
                 for n, s in (("baseline", base), ("swaps", swap))]))
    print(f"\nswaps applied {serve_swaps}/{len(published)}; engine stall per swap: median {percentile(stalls, 50):.1f} ms, "
          f"max {max(stalls):.1f} ms (load median {percentile(loads, 50):.1f} ms); max client gap around a swap "
          f"{max(near_gaps) if near_gaps else float('nan'):.0f} ms vs {base['gap_max_ms']:.0f} ms max gap without swaps")
    first = all_swaps[0] if all_swaps else None
    first_swap = {"version": first["version"], "engine_stall_ms": 1e3 * (first["resume"] - first["pause"]),
                  "load_ms": 1e3 * (first["load_end"] - first["load_start"])} if first and first["resume"] and first["pause"] else None
    if first_swap:
        print(f"first swap of this server (v{first_swap['version']}, the first write into the loaded model's weights): "
              f"engine stall {first_swap['engine_stall_ms']:.0f} ms, load {first_swap['load_ms']:.0f} ms")
    print(f"TPOT p50 {base['tpot_p50_ms']:.1f} -> {swap['tpot_p50_ms']:.1f} ms ({100 * (swap['tpot_p50_ms'] / base['tpot_p50_ms'] - 1):+.1f}%), "
          f"p99 {base['tpot_p99_ms']:.1f} -> {swap['tpot_p99_ms']:.1f} ms ({100 * (swap['tpot_p99_ms'] / base['tpot_p99_ms'] - 1):+.1f}%)")
    print(f"failed/aborted: {failures} (client failures {client_failures}, engine aborts {engine_aborted}, "
          f"aborted turns {aborted_turns}) -> {'OK' if failures == 0 else 'FAIL'}")
    print(f"versions: {len(turns)} turns on NATS for {len(all_records)} timed requests (+ warm-up, incl. discarded phases); {spanning} span a swap; "
          f"non-decreasing violations {len(bad_order)}, unpublished versions {len(bad_value)}, client/turn mismatches "
          f"{mismatched}, turns missing {missing}, tokens labelled before their version loaded {early} -> "
          f"{'OK' if versions_ok else 'FAIL'}")
    path = write_result(f"hot_swap_{args.model}", {
        "model": args.model, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "swaps": args.swaps,
        "interval_s": args.interval, "phase_s": args.phase_s, "seed": args.seed, "machine": machine(args.threads),
        "store_write_s": write_s, "per_swap": per_swap, "first_swap": first_swap, "serve_pauses_s": serve_pauses, "swaps_applied": serve_swaps,
        "versions_published": len(published), "attempts": {n: phases[n]["attempt"] for n in phases},
        "discarded_phases": [{"name": d["name"], "cpu": d["cpu"]} for d in discarded],
        "baseline": base, "with_swaps": swap,
        "server_gc_passes_over_5ms": [{"at_s": t - phases["baseline"]["t0"], "ms": 1e3 * d, "generation": gen}
                                      for t, d, gen in gc_log.passes],
        "largest_gaps": {"baseline": largest_gaps(phases["baseline"]), "swaps": largest_gaps(phases["swaps"])},
        "cpu": {n: phases[n]["cpu"] for n in phases}, "waited_for_quiet": {n: phases[n]["quiet"] for n in phases},
        "client_cpu_s": {n: phases[n]["client_cpu_s"] for n in phases},
        "failures": failures, "engine_aborted": engine_aborted, "aborted_turns": aborted_turns,
        "versions": {"turns": len(turns), "spanning_a_swap": spanning, "non_decreasing_violations": len(bad_order),
                     "unpublished_versions": len(bad_value), "client_turn_mismatches": mismatched, "turns_missing": missing,
                     "tokens_before_load": early, "ok": versions_ok, "mismatch_examples": mismatch_examples},
        "recorder": recorder,
    })
    print(f"wrote {path}")


def write_versions_main(args: argparse.Namespace) -> None:
    """The trainer stand-in: publish versions first..first+swaps-1 (each a little different) to
    the store, print the seconds each write took as JSON."""
    quiet_logs()
    import torch

    from models import WeightStore, load_model

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
    logging.getLogger("serve.engine.core").setLevel(logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
