"""What a hot-swap run's records say (`bench/hot_swap.py`): each phase's client-side figures
(requests, tok/s, TPOT, inter-token gaps, TTFT), each swap's cost (the engine's stall and load, the
pool's pause, announcement to live, the largest client gap around it), the largest gaps and what
the garbage collector took of them, and whether every token's version is right."""

from __future__ import annotations

import itertools

from bench.lib.common import ms, percentile, tpot_s, ttft_s


def phase_stats(records: list[dict], t0: float) -> dict:
    """A phase's client-side figures: requests ok and failed, tok/s, TPOT, inter-token gaps, TTFT."""
    ok = [r for r in records if r["done"] and not r["error"] and r["finish_reason"] in ("stop", "length") and r["tokens"]]
    failed = [r for r in records if r not in ok]
    tokens = sum(r["tokens"] for r in ok)
    tpot = tpot_s(ok)
    gaps = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    ttft = ttft_s(ok)
    end = max(((r["t_finish"] or r["t_send"]) for r in records), default=t0)
    wall = max(end - t0, 1e-9)
    return {
        "requests": len(records), "ok": len(ok), "failed": len(failed),
        "failures": [{k: r[k] for k in ("error", "finish_reason", "done")} for r in failed[:5]],
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "gap_p50_ms": ms(percentile(gaps, 50)), "gap_p99_ms": ms(percentile(gaps, 99)), "gap_max_ms": ms(max(gaps, default=None)),
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
    }


def swap_costs(swaps: list[dict], pool_pause_of: dict[int, float], swap_phase: dict) -> list[dict]:
    """Per swap of the swap phase: the engine's stall (pause to resume) and load, the pool's pause
    (`ServeLoop.pauses`), announcement to live, and the largest client gap overlapping the stall."""
    gaps = [(a, b) for r in swap_phase["records"] for a, b in zip(r["chunks"], r["chunks"][1:])]
    per_swap = []
    for s in swaps:
        stall = s["resume"] - s["pause"] if s["resume"] and s["pause"] else None
        near = [b - a for a, b in gaps if s["pause"] and a <= (s["resume"] or s["load_end"]) and b >= s["pause"]]
        announced = swap_phase["announced"].get(s["version"])
        per_swap.append({
            "version": s["version"], "engine_stall_ms": 1e3 * stall if stall is not None else None,
            "load_ms": 1e3 * (s["load_end"] - s["load_start"]),
            "pool_pause_ms": 1e3 * pool_pause_of[s["version"]] if s["version"] in pool_pause_of else None,
            "announce_to_live_ms": 1e3 * (s["resume"] - announced) if announced and s["resume"] else None,
            "max_client_gap_ms": 1e3 * max(near) if near else None,
        })
    return per_swap


def first_swap_cost(all_swaps: list[dict]) -> dict | None:
    """The server's first swap (the first write into the loaded model's weights): stall and load."""
    first = all_swaps[0] if all_swaps else None
    if not (first and first["resume"] and first["pause"]):
        return None
    return {"version": first["version"], "engine_stall_ms": 1e3 * (first["resume"] - first["pause"]),
            "load_ms": 1e3 * (first["load_end"] - first["load_start"])}


def largest_gaps(phase: dict, pauses_at: list[float], gc_passes: list[tuple[float, float, int]], near_swaps: bool) -> list[dict]:
    """The 5 largest inter-token gaps of a phase: when (s into the phase), how long, how far the
    nearest swap's pause was from the gap's start (`near_swaps`: the swap phase), and how much of
    it the server's garbage collector took."""
    found = sorted(((b - a, a) for r in phase["records"] for a, b in zip(r["chunks"], r["chunks"][1:])), reverse=True)[:5]
    return [{"gap_ms": 1e3 * g, "at_s": a - phase["t0"],
             "nearest_swap_pause_s": min((p - a for p in pauses_at), key=abs) if pauses_at and near_swaps else None,
             "server_gc_ms_inside": 1e3 * sum(d for t, d, _ in gc_passes if a <= t <= a + g)}
            for g, a in found]


def version_checks(turns: dict, records: list[dict], published: set[int], loaded_at: dict[int, float]) -> dict:
    """The bus's turns (non-decreasing versions, only published ones), and each client request's
    per-chunk fingerprints against its recorded turn; tokens labelled before their version loaded."""
    allowed = {0} | published
    bad_order = [t.id for t in turns.values() if any(b < a for a, b in zip(t.output_versions, t.output_versions[1:]))]
    bad_value = [t.id for t in turns.values() if not set(t.output_versions) <= allowed]
    spanning = sum(1 for t in turns.values() if len(set(t.output_versions)) > 1)
    by_turn_id = {f"{r['id'].removeprefix('chatcmpl-')}-0": r for r in records if r.get("id")}
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
    ok = not bad_order and not bad_value and not mismatched and not missing and not early
    return {"turns": len(turns), "spanning_a_swap": spanning, "non_decreasing_violations": len(bad_order),
            "unpublished_versions": len(bad_value), "client_turn_mismatches": mismatched, "turns_missing": missing,
            "tokens_before_load": early, "ok": ok, "mismatch_examples": mismatch_examples}


def analyse(phases: dict[str, dict], discarded: list[dict], all_swaps: list[dict], server: dict, published: set[int],
            gc_passes: list[tuple[float, float, int]]) -> dict:
    """What the report prints and the JSON keeps, from the phases' client records (discarded
    phases count for failures and versions), the engine's timeline and the server side."""
    swap_phase = phases["swaps"]
    swaps = [s for s in all_swaps if s["version"] in swap_phase["versions"]]
    pool_pause_of = {s["version"]: p for s, p in zip(all_swaps, server["pauses"])}
    pauses_at = [s["pause"] for s in swaps if s["pause"]]
    loaded_at = {s["version"]: s["load_end"] for s in all_swaps}
    every_phase = [*phases.values(), *discarded]
    records = [r for ph in every_phase for r in ph["records"]]
    aborted_turns = sum(1 for t in server["turns"].values() if t.finish_reason == "abort")
    client_failures = sum(phase_stats(ph["records"], ph["t0"])["failed"] for ph in every_phase)
    return {
        "baseline": phase_stats(phases["baseline"]["records"], phases["baseline"]["t0"]),
        "with_swaps": phase_stats(swap_phase["records"], swap_phase["t0"]),
        "per_swap": swap_costs(swaps, pool_pause_of, swap_phase),
        "first_swap": first_swap_cost(all_swaps),
        "largest_gaps": {"baseline": largest_gaps(phases["baseline"], pauses_at, gc_passes, near_swaps=False),
                         "swaps": largest_gaps(swap_phase, pauses_at, gc_passes, near_swaps=True)},
        "versions": version_checks(server["turns"], records, published, loaded_at),
        "timed_requests": len(records),
        "client_failures": client_failures, "aborted_turns": aborted_turns,
        "failures": client_failures + server["engine_aborted"] + aborted_turns,
    }
