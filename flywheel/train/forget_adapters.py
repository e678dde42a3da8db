"""The trainer's side of forgetting (`adapters.kind: lora`): a tenant or end user forgotten
(`flywheel forget`, `POST /admin/forget`: flywheel/tenants/forget.py, which deletes their adapters
from the store and then puts a `forget` entry on the audit log) is forgotten by the trainer too.

The trainer hears of it on the audit log (flywheel/train/audit_requests.py), and between two
steps `forget` drops what it heard of: the adapters they own
(`adapter_store.owned_by`: a user's own, or the tenant's and all its users') with their PEFT
weights, optimizer and schedule (`AdapterSet.drop`), their versions and any directory of theirs a
step under way published meanwhile (`AdapterVersions.drop`), the system messages of their
conversations kept for the guard (`AdapterVersions.forget`), their reward baselines, and the
samples of theirs held for a step (acknowledged: the stream no longer holds them). Every
checkpoint on disk is rewritten without those adapters (`scrub`: each `state.pt` replaced), and
the loop then saves a checkpoint at once. An audit entry (`forget.adapters`, actor `train`) says
so, and every gateway unloads their adapters again on it: a version that a step under way
published after the forgetting, and a gateway loaded, is not served on. A user who comes back is
a new user: their adapter starts again from its origin, at version 0. A trainer that was stopped
when the forgetting happened drops them once it starts, from the state it restored; a forgotten
user who came back since, and whose new adapter a later checkpoint holds, is not forgotten again
(which entries count: flywheel/train/audit_requests.py). A replaced `state.pt` is unlinked, not
overwritten: its old blocks stay on the disk until reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flywheel.bus import Bus, Sample
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.models.adapter_store import DROPPED, owned_by
from flywheel.tenants.forgotten import forgets, target_of
from flywheel.train.checkpoint import FILES, Checkpoints

if TYPE_CHECKING:
    from flywheel.train.loop import TrainLoop

log = logging.getLogger(__name__)


async def forget(loop: TrainLoop, bus: Bus, forgotten: list[tuple[str, str | None]]) -> None:
    """Drop from `loop` the tenants and end users `forgotten` ((tenant, user or None) each), and
    rewrite its checkpoints without their adapters (the loop then checkpoints at once)."""
    adapters = loop.trainer.adapters
    assert adapters is not None

    def theirs(sample: Sample) -> bool:
        return any(forgets(each, (sample.trajectory.tenant, sample.trajectory.user_id)) for each in forgotten)

    for group in loop.batcher.drop_stale(theirs):
        for delivery in group.deliveries:
            with contextlib.suppress(Exception):  # the message is gone from the stream already
                await delivery.ack()
    dropped = {(tenant, user): owned_by(adapters.names(), tenant, user) for tenant, user in forgotten}
    names = {name for owned in dropped.values() for name in owned}
    for name in names:
        adapters.drop(name)
        loop.adapter_versions.drop(name)
        loop.baseline.adapters.pop(name, None)
    for tenant, user in forgotten:
        loop.adapter_versions.forget(tenant, user)  # the system messages their conversations gave the guard
    rewritten = await asyncio.to_thread(scrub, loop.checkpoints, names) if names else 0
    for (tenant, user), owned in dropped.items():
        await bus.publish(AUDIT_SUBJECT, AuditEntry(
            id=uuid.uuid4().hex, actor="train", action=DROPPED, target=target_of(tenant, user),
            details={"tenant": tenant, "user": user, "adapters": len(owned), "checkpoints": rewritten}))
    log.info("forgot %d adapters; %d checkpoints rewritten without them", len(names), rewritten)


def scrub(checkpoints: Checkpoints, names: set[str]) -> int:
    """Rewrite every checkpoint that holds one of the adapters `names` without them (weights,
    optimizer, schedule, versions, baseline); how many were rewritten."""
    rewritten = 0
    for step in checkpoints.steps():
        path = checkpoints.path(step) / "state.pt"
        state = torch.load(path, weights_only=False)
        saved, loop = state["trainer"].get("adapters", []), state["loop"]
        versions = loop.get("adapters", {})
        tables = [versions.get("versions", {}), versions.get("parents", {}), loop.get("adapter_baselines", {})]
        if not any(a["name"] in names for a in saved) and not any(names.intersection(t) for t in tables):
            continue
        state["trainer"]["adapters"] = [a for a in saved if a["name"] not in names]
        for table in tables:
            for name in names:
                table.pop(name, None)
        rewrite(path, state)
        rewritten += 1
    return rewritten


def rewrite(path: Path, state: dict) -> None:
    """A checkpoint's `state.pt` at `path` replaced by `state` (atomically: aside, fsynced, renamed
    over it) with the time it was saved kept (it says how far the trainer had read the audit log:
    `AuditRequests.since`; what was asked since is still carried out when the trainer starts), and
    the adapter files its `files/` holds that `state` no longer names removed (the trainer kept
    them on disk; and any a crash left)."""
    saved = path.stat()
    aside = path.with_name(f".{path.name}.rewritten")
    with aside.open("wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.utime(aside, ns=(saved.st_atime_ns, saved.st_mtime_ns))
    os.replace(aside, path)
    kept = {a["file"].path.name for a in state["trainer"].get("adapters", []) if "file" in a}
    for stray in (path.parent / FILES).glob("*"):
        if stray.name not in kept:
            stray.unlink()
