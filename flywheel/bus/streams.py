"""JetStream streams, their subjects, and which record type each subject carries.

One stream per hand-off between loops. Turns and session events share the TRAFFIC stream so
that a collector sees a session's feedback after the turns that one gateway published before
it (JetStream orders messages within a stream).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from flywheel.bus.instructions import Instructions
from flywheel.bus.records import (
    AuditEntry,
    Record,
    Sample,
    SessionEvent,
    Trajectory,
    Turn,
    Unscored,
    WeightUpdate,
)
from flywheel.versions.records import Routing, TrainerDirective, VersionCommand


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    """How long records are kept (for replay, `flywheel tail` and late consumers)."""
    max_msgs_per_subject: int = -1
    tenant_records: bool = False
    """Holds tenants' traffic: each record may carry its tenant's own age limit (`Nats-TTL`)."""


TRAFFIC_SUBJECTS = "flywheel.traffic.>"
"""Turns and session events together, in the order they were published."""
TURN_SUBJECT = "flywheel.traffic.turn"
SESSION_EVENT_SUBJECT = "flywheel.traffic.event"
TRAJECTORY_SUBJECT = "flywheel.trajectories"
SAMPLE_SUBJECT = "flywheel.samples"
UNSCORED_SUBJECT = "flywheel.unscored"
WEIGHTS_SUBJECT = "flywheel.weights"
AUDIT_SUBJECT = "flywheel.audit"
"""Administrative actions, who did them and when (the admin API, `flywheel forget`, the promotion loop)."""
MEMORY_SUBJECTS = "flywheel.memory.>"
"""Each person's instructions for replies, read from their corrections (`memory.enabled`), on a
subject of their own (`memory_subject`): the stream keeps each person's newest record only."""
COMMANDS_SUBJECT = "flywheel.versions.commands"
"""Operators' requests to the promotion loop (`flywheel versions`, the gateway's admin routes)."""
REGISTRY_BUCKET = "FLYWHEEL_VERSIONS"
"""The version registry's key-value bucket (flywheel/versions/registry.py)."""
ROUTING_SUBJECT = f"$KV.{REGISTRY_BUCKET}.routing"
"""The registry's routing key, as a subject gateways follow."""
DIRECTIVE_SUBJECT = f"$KV.{REGISTRY_BUCKET}.trainer"
"""The registry's trainer directive, as a subject (written on every rejection and rollback)."""

DAY = 24 * 3600.0

TRAFFIC = StreamSpec("TRAFFIC", (TRAFFIC_SUBJECTS,), max_age_s=7 * DAY, tenant_records=True)
TRAJECTORIES = StreamSpec("TRAJECTORIES", (TRAJECTORY_SUBJECT,), max_age_s=7 * DAY, tenant_records=True)
SAMPLES = StreamSpec("SAMPLES", (SAMPLE_SUBJECT,), max_age_s=7 * DAY, tenant_records=True)
UNSCORED = StreamSpec("UNSCORED", (UNSCORED_SUBJECT,), max_age_s=30 * DAY, tenant_records=True)
MEMORY = StreamSpec("MEMORY", (MEMORY_SUBJECTS,), max_age_s=7 * DAY, max_msgs_per_subject=1, tenant_records=True)
WEIGHTS = StreamSpec("WEIGHTS", (WEIGHTS_SUBJECT,), max_age_s=30 * DAY, max_msgs_per_subject=64)
COMMANDS = StreamSpec("VERSION_COMMANDS", (COMMANDS_SUBJECT,), max_age_s=30 * DAY)
AUDIT = StreamSpec("AUDIT", (AUDIT_SUBJECT,), max_age_s=400 * DAY)

STREAMS: dict[str, StreamSpec] = {s.name: s for s in (TRAFFIC, TRAJECTORIES, SAMPLES, UNSCORED, MEMORY, WEIGHTS, COMMANDS, AUDIT)}

RECORD_TYPES: dict[str, type[Record]] = {
    TURN_SUBJECT: Turn,
    SESSION_EVENT_SUBJECT: SessionEvent,
    TRAJECTORY_SUBJECT: Trajectory,
    SAMPLE_SUBJECT: Sample,
    UNSCORED_SUBJECT: Unscored,
    MEMORY_SUBJECTS: Instructions,  # and each person's subject under it
    WEIGHTS_SUBJECT: WeightUpdate,
    COMMANDS_SUBJECT: VersionCommand,
    AUDIT_SUBJECT: AuditEntry,
    ROUTING_SUBJECT: Routing,  # keys of the registry's bucket (flywheel/versions/registry.py), not streams of their own
    DIRECTIVE_SUBJECT: TrainerDirective,
}
"""Which record type a subject carries; the bus decodes by subject (`record_type`)."""


def record_type(subject: str) -> type[Record] | None:
    """The record type `subject` carries, or None: its own, or its family's (`flywheel.memory.<person>`
    carries `flywheel.memory.>`'s)."""
    return RECORD_TYPES.get(subject) or RECORD_TYPES.get(subject.rpartition(".")[0] + ".>")


def carried_by(subject: str) -> type[Record]:
    """`record_type`, for a subject a caller names: a KeyError when there is none."""
    kind = record_type(subject)
    if kind is None:
        raise KeyError(f"no record type is defined for {subject}")
    return kind


def memory_subject(tenant: str, user_id: str | None) -> str:
    """A person's own subject on MEMORY: a digest of their tenant and user id (no id's characters
    reach a subject; an empty user id is the person who names none, as the gateway reads it)."""
    return "flywheel.memory." + hashlib.sha256(f"{tenant}\0{user_id or ''}".encode()).hexdigest()[:32]
