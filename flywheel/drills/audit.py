"""The audit of a drill: for the sessions the agents were told were recorded (every turn and the
feedback answered 200), what the streams and the trainer's ledger hold.

- `lost`: no trajectory; `truncated`: a trajectory missing a turn or the feedback;
- `duplicated_*`: more than one trajectory for a session, or a trajectory or sample twice in the
  stream; `trained_twice`: samples trained twice in the weights' lineage;
- whether the announced versions only grew.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from flywheel.drills.agents import Load

FAILURES = ("lost", "truncated", "duplicated_sessions", "duplicated_trajectories", "duplicated_samples", "trained_twice",
            "server_errors", "sessions_failed")
"""The audit's counts that must be 0."""


async def read_stream(bus: Any, stream: str, kind: type) -> list[Any]:
    """Every record in a stream, in order (gets by sequence)."""
    from nats.js.errors import NotFoundError

    from flywheel.bus import decode
    from flywheel.bus.large import read_payload

    info = await bus.js.stream_info(stream)
    records = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):  # an empty stream: first_seq 0
        try:
            raw = await bus.get_message(stream, seq)
        except NotFoundError:  # deleted or expired
            continue
        records.append(decode(await read_payload(bus, raw.data, raw.headers), kind))
    return records


async def audit(bus_url: str, run_dir: Path, load: Load, turns: int) -> dict[str, Any]:
    from flywheel.bus import Bus, Sample, Trajectory, WeightUpdate
    from flywheel.train.ledger import lineage

    bus = await Bus.connect(bus_url, name="audit", ensure_streams=False)
    try:
        trajectories = await read_stream(bus, "TRAJECTORIES", Trajectory)
        samples = await read_stream(bus, "SAMPLES", Sample)
        updates = await read_stream(bus, "WEIGHTS", WeightUpdate)
        replicas = (await bus.js.stream_info("TRAFFIC")).config.num_replicas
    finally:
        await bus.close()
    by_session: dict[str, list[Any]] = defaultdict(list)
    for trajectory in trajectories:
        by_session[trajectory.session_id].append(trajectory)
    complete = truncated = lost = 0
    for sid in load.answered:
        found = by_session.get(sid, [])
        if not found:
            lost += 1
            continue
        indices = {t.turn_index for t in found[0].turns}
        rewarded = any(e.reward is not None for e in found[0].feedback)
        if indices >= set(range(turns)) and rewarded:
            complete += 1
        else:
            truncated += 1
    trajectory_copies = Counter(t.id for t in trajectories)
    sample_copies = Counter(s.id for s in samples)
    ledger = run_dir / "trained.jsonl"
    trained = Counter(sid for step in lineage(ledger) for sid in step["samples"]) if ledger.exists() else Counter()
    versions = [u.version for u in updates]
    answered = [by_session[sid][0] for sid in load.answered if by_session.get(sid)]
    return {
        "segments_per_trajectory": round(sum(len(t.segments) for t in answered) / max(len(answered), 1), 2),
        "stream_replicas": replicas,
        "sessions_answered": len(load.answered),
        "sessions_failed": len(load.failed),
        "requests": load.requests,
        "server_errors": load.server_errors,
        "complete": complete,
        "lost": lost,
        "truncated": truncated,
        "duplicated_sessions": sum(1 for sid in load.answered if len(by_session.get(sid, [])) > 1),
        "duplicated_trajectories": sum(n - 1 for n in trajectory_copies.values()),
        "samples": len(sample_copies),
        "duplicated_samples": sum(n - 1 for n in sample_copies.values()),
        "trained": len(trained),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "versions_increasing": all(a < b for a, b in zip(versions, versions[1:])),
        "versions": versions[-1] if versions else None,
    }
