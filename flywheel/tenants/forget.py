"""Forgetting a tenant, or one end user of a tenant: every record of theirs removed from the bus
and the run directory, and a report of what was removed and which versions learned from them.

What goes:
- their records on every stream that holds traffic (TRAFFIC: turns and session events;
  TRAJECTORIES; SAMPLES; UNSCORED; MEMORY: the instructions read from their corrections), each
  message deleted and its storage overwritten (JetStream's secure erase), with the object a
  large record's body was kept in;
- the sessions they opened (`FLYWHEEL_SESSIONS`), so feedback naming one is a 404 again;
- their records waiting in the gateways' spill files (each file rewritten without them);
- for a whole tenant, its keys made or changed at run time (`FLYWHEEL_TENANTS`): revoked, first;
- their LoRA adapters (`adapters.kind: lora`) in the run directory's adapter store
  (`run_dir/adapters`, the run directory being the ledger's): a user's own adapter, or the
  tenant's and all its users' (`adapter_store.owned_by`). Every gateway unloads them from its
  engines and the trainer drops them, its checkpoints rewritten without them, when they read the
  audit entry (flywheel/serve/loop.py, flywheel/train/forget_adapters.py).

A user is matched by the end-user id on their turns, trajectories and samples, and their
sessions go whole: a session event carries no user, and another person's turns in a session they
shared hold their words in its prompts. What stays is the lineage:
`trained.jsonl` and each version's `trained_on` name samples by digest (`sample_digest`), never
by id, so nothing readable is left, and the digests of the forgotten samples say which versions
trained on them: those weights still hold what they learned (retraining them without the
forgotten samples is the operator's decision: `flywheel forget --retrain`,
flywheel/train/retrain.py). Two audit entries say who asked and when: `forget.begin` before
anything is deleted (the gateways and the collector stop keeping what of theirs is under way or
held, and the judge what it remembers of them), and `forget`, with what was removed, once it is
done (the trainer forgets then).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, NotFoundError

from flywheel.bus.large import HEADER
from flywheel.bus.records import (
    AuditEntry,
    Record,
    Sample,
    SessionEvent,
    Trajectory,
    Turn,
    Unscored,
    decode,
    sample_digest,
    tenant_of,
)
from flywheel.bus.scan import stored_records
from flywheel.bus.streams import (
    AUDIT_SUBJECT,
    MEMORY,
    SAMPLES,
    TRAFFIC,
    TRAJECTORIES,
    UNSCORED,
    carried_by,
)
from flywheel.models.adapter_store import AdapterStore
from flywheel.tenants.forgotten import BEGUN, target_of
from flywheel.tenants.records import KeyEntry
from flywheel.tenants.sessions import BUCKET as SESSIONS_BUCKET
from flywheel.tenants.sessions import session_key

log = logging.getLogger(__name__)
STREAMS = (TRAFFIC.name, TRAJECTORIES.name, SAMPLES.name, UNSCORED.name, MEMORY.name)


@dataclass
class Forgotten:
    """What `forget` removed, and which versions trained on what it removed."""

    tenant: str
    user: str | None
    records: dict[str, int] = field(default_factory=dict)
    """Messages deleted, by stream."""
    large_objects: int = 0
    sessions: int = 0
    spilled: int = 0
    """Records removed from the gateways' spill files."""
    samples: int = 0
    adapters: int = 0
    """Adapters deleted from the adapter store (counted: their names are digests of user ids)."""
    versions: list[int] = field(default_factory=list)
    """Versions whose training steps used forgotten samples (`trained.jsonl`)."""
    sample_digests: set[str] = field(default_factory=set, repr=False)
    """The forgotten samples, by digest (for `--retrain`; not reported)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "sample_digests"}


def user_of(record: Record) -> str | None:
    if isinstance(record, Unscored):
        return record.trajectory.user_id
    return getattr(record, "user_id", None)


def session_of(record: Record) -> str | None:
    """The session a record is of (a sample that refers to its trajectory: by its id,
    `<session>#<digest>`)."""
    if isinstance(record, (Unscored, Sample)) and record.trajectory is not None:
        return record.trajectory.session_id
    if isinstance(record, Sample):
        return record.id.rpartition("#")[0]
    return getattr(record, "session_id", None)


class Matcher:
    """Whether a record is the forgotten tenant's (and user's). A user's sessions go whole: their
    events, and the turns and trajectories another person had in a session they shared, whose
    prompts hold the forgotten user's words."""

    def __init__(self, tenant: str, user: str | None):
        self.tenant, self.user = tenant, user
        self.sessions: set[str] = set()
        """The sessions their turns were in: everything of those goes too."""
        self.sample_digests: set[str] = set()

    def __call__(self, record: Record) -> bool:
        if tenant_of(record) != self.tenant:
            return False
        if self.user is not None and (isinstance(record, SessionEvent) or user_of(record) != self.user):
            if session_of(record) not in self.sessions:
                return False
        elif isinstance(record, (Turn, Trajectory)):
            self.sessions.add(record.session_id)
        if isinstance(record, Sample):
            self.sample_digests.add(sample_digest(record.id))
        return True


async def forget(bus: Any, tenant: str, user: str | None = None, spill_dirs: Iterable[Path] = (),
                 ledger: Path | None = None, actor: str = "cli") -> Forgotten:
    """Remove `tenant`'s (or its `user`'s) records everywhere; see the module docstring."""
    report = Forgotten(tenant, user)
    await bus.publish(AUDIT_SUBJECT, AuditEntry(id=uuid.uuid4().hex, actor=actor, action=BEGUN,
                                                target=target_of(tenant, user), details={"tenant": tenant, "user": user}))
    if user is None:
        await _forget_tenant_entry(bus, tenant)
    matches = Matcher(tenant, user)
    # A user's sessions are known from their records as the streams are read; a second pass takes
    # what came before (an event before their first turn, another's turn or trajectory before theirs).
    for stream in STREAMS * (2 if user is not None else 1):
        deleted, large = await delete_matching(bus, stream, matches)
        report.records[stream] = report.records.get(stream, 0) + deleted
        report.large_objects += large
    report.sample_digests = matches.sample_digests
    report.samples = len(matches.sample_digests)
    report.sessions = await _forget_sessions(bus, matches.sessions)
    for directory in spill_dirs:
        report.spilled += _scrub_spill(Path(directory), matches)
    if ledger is not None and ledger.exists():
        report.versions = _versions_trained_on(ledger, matches.sample_digests)
    if ledger is not None and (ledger.parent / "adapters").is_dir():
        report.adapters = len(AdapterStore(ledger.parent / "adapters").forget(tenant, user))
    await bus.publish(AUDIT_SUBJECT, AuditEntry(
        id=uuid.uuid4().hex, actor=actor, action="forget", target=target_of(tenant, user),
        details=report.as_dict()))
    return report


async def delete_matching(bus: Any, stream: str, matches: Matcher) -> tuple[int, int]:
    """Delete (and overwrite) every message of `stream` whose record matches; (deleted, large objects)."""
    deleted = large = 0
    async for stored in stored_records(bus, stream):
        if not matches(stored.record):
            continue
        await bus.js.delete_msg(stream, stored.seq)  # nats-py erases (overwrites) by default
        deleted += 1
        if stored.headers and HEADER in stored.headers:
            await (await bus.large._bucket()).delete(stored.headers[HEADER])
            large += 1
    return deleted, large


async def _forget_sessions(bus: Any, sessions: set[str]) -> int:
    try:
        kv = await bus.js.key_value(SESSIONS_BUCKET)
    except NotFoundError:
        return 0
    removed = 0
    for session in sessions:
        try:
            await kv.purge(session_key(session))
            removed += 1
        except KeyNotFoundError:
            pass
    return removed


async def _forget_tenant_entry(bus: Any, tenant: str) -> None:
    """The tenant's run-time entry, if it has one, written again with every key revoked and the
    time it was forgotten, its settings as they were (a tenant of the configuration that stopped
    training or keeping must not start again; a key is only its digest, nothing of its people).
    Done first, so that no key of theirs opens anything while their records are deleted."""
    from flywheel.tenants.registry import Changed, TenantRegistry

    registry = await TenantRegistry.open(bus)
    while True:
        entry, revision = await registry.read(tenant)
        if entry is None:
            return
        revoked = [KeyEntry(id=key.id, digest=key.digest, revoked=True) for key in entry.keys]
        try:  # over exactly what was read: a key made meanwhile is read again, and revoked
            return await registry.write(msgspec.structs.replace(entry, keys=revoked, updated_at=time.time(),
                                                                forgotten_at=time.time()), revision)
        except Changed:
            continue


def _scrub_spill(directory: Path, matches: Matcher) -> int:
    """Rewrite each spill file in `directory` without the matching records; how many went."""
    removed = 0
    for path in sorted(directory.glob("spill-*.jsonl")):
        kept: list[bytes] = []
        lines = path.read_bytes().splitlines(keepends=True)
        for line in lines:
            try:
                entry = json.loads(line)
                record = decode(json.dumps(entry["record"]).encode(), carried_by(entry["subject"]), "json")
            except (ValueError, KeyError, msgspec.ValidationError, msgspec.DecodeError):
                kept.append(line)  # not ours to judge: the recorder skips what it cannot read
                continue
            if matches(record):
                removed += 1
            else:
                kept.append(line)
        if len(kept) != len(lines):
            tmp = path.with_suffix(".forget")
            tmp.write_bytes(b"".join(kept))
            tmp.replace(path)
    return removed


def _versions_trained_on(ledger: Path, digests: set[str]) -> list[int]:
    versions: Counter[int] = Counter()
    for line in ledger.read_text().splitlines():
        step = json.loads(line) if line.strip() else {}
        if digests.intersection(step.get("samples", [])):
            versions[step["version"]] += 1
    return sorted(versions)
