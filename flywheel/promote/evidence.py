"""Online evidence: judged samples, attributed to the version that sampled them.

The promoter reads SAMPLES with its own durable consumer (the trainer's is separate: both see
every sample). A sample counts for a version when every token it trained on was sampled by that
version (a session that crossed a swap counts for none). Each version's online reward goes into
its registry entry, one row per 15 s (`VersionEntry.online`: what the dashboard draws). While a
canary runs, its samples feed the canary arm of the sequential test, and the serving version's
samples judged meanwhile (concurrent sessions) feed the serving arm.

Operations: the promoter also reads the recorded turns (TRAFFIC) while a canary runs: each arm's
share of turns the engine or a timeout cut short (`finish_reason` abort without the client going
away), and its median time per output token after the first. Either far worse on the canary
(`promotion.canary.max_error_rate_increase`, `max_latency_ratio`) rolls it back at once.

Exactly once: a canary's entry keeps the stream sequence of the last sample it applied
(`applied_seq`), written with the arms, and each version's entry that of the last sample in its
online series (`online_seq`, written before the arms); a redelivered sample at or below it is
skipped, so a promoter killed between writing and acknowledging does not count a sample twice
(the same for turns, `applied_turn_seq`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from statistics import median

from flywheel.bus import Delivery, Sample, Turn
from flywheel.config.promotion import CanaryConfig
from flywheel.versions.records import VersionEntry

ONLINE_BUCKET_S = 15
"""The online reward series' resolution."""
ONLINE_ROWS = 24 * 60
"""Rows of online reward kept per version (six hours; Prometheus keeps the long history)."""
LATENCY_SAMPLES = 256
"""Recent times per output token kept per arm."""


def sampling_version(sample: Sample) -> int | None:
    """The version that sampled all of the sample's trained tokens, or None (several, or none)."""
    versions = {v for seg in sample.trajectory.segments for v, m in zip(seg.versions, seg.loss_mask) if m}
    return versions.pop() if len(versions) == 1 else None


def add_online(entry: VersionEntry, seen: list[tuple[int, float]], now: float | None = None) -> bool:
    """Count (stream sequence, reward) of judged samples in the entry's online series, those past
    its `online_seq` only; whether any were."""
    rewards = [r for seq, r in seen if seq > entry.online_seq]
    if not rewards:
        return False
    entry.online_seq = max(seq for seq, _ in seen)
    bucket = float(int((now or time.time()) // ONLINE_BUCKET_S * ONLINE_BUCKET_S))
    if entry.online and entry.online[-1][0] == bucket:
        entry.online[-1][1] += len(rewards)
        entry.online[-1][2] += sum(rewards)
    else:
        entry.online.append([bucket, float(len(rewards)), float(sum(rewards))])
    del entry.online[:-ONLINE_ROWS]
    return True


def by_version(deliveries: list[Delivery]) -> dict[tuple[str | None, int], list[tuple[int, float]]]:
    """(stream sequence, reward) of each judged sample, by the version that sampled it: (its
    adapter, None for the shared weights; the version)."""
    out: dict[tuple[str | None, int], list[tuple[int, float]]] = defaultdict(list)
    for delivery in deliveries:
        sample: Sample = delivery.record  # type: ignore[assignment]
        version = sampling_version(sample)
        if version is not None and sample.reward is not None:
            out[sample.trajectory.adapter, version].append((delivery.stream_seq, float(sample.reward)))
    return out


def new_operations() -> dict:
    return {"turns": 0, "failed": 0, "tpot": []}


def add_turn(arm: dict, turn: Turn) -> None:
    """Count a recorded turn in an arm's operations (`new_operations`)."""
    arm["turns"] += 1
    arm["failed"] += turn.finish_reason == "abort" and not turn.client_disconnected
    if len(turn.output_ids) > 1 and turn.timings.total_s > turn.timings.first_token_s > 0:
        arm["tpot"] = [*arm["tpot"], (turn.timings.total_s - turn.timings.first_token_s) / (len(turn.output_ids) - 1)]
        del arm["tpot"][:-LATENCY_SAMPLES]


def turn_version(turn: Turn) -> int | None:
    versions = set(turn.output_versions)
    return versions.pop() if len(versions) == 1 else None


def operations_verdict(canary: dict, serving: dict, config: CanaryConfig) -> str | None:
    """Why the canary must be rolled back at once, from its operations; None when it need not."""
    if min(canary["turns"], serving["turns"]) < config.min_sessions:
        return None
    rates = canary["failed"] / canary["turns"], serving["failed"] / serving["turns"]
    if rates[0] - rates[1] > config.max_error_rate_increase:
        return f"{rates[0]:.0%} of its turns failed against {rates[1]:.0%} of the serving version's"
    if config.max_latency_ratio is not None and canary["tpot"] and serving["tpot"]:
        ratio = median(canary["tpot"]) / max(median(serving["tpot"]), 1e-9)
        if ratio > config.max_latency_ratio:
            return f"its median time per output token is {ratio:.1f}x the serving version's"
    return None
