"""The tenant drill's audit: where each session's marker strings and personal data ended up, and
whether what each tenant's policy keeps was kept whole and trained (or not) as it says.

Scans, for every marker and raw personal-data value the agents sent (`tenant_load.Session`):
- every message of every stream on the bus (TRAFFIC, TRAJECTORIES, SAMPLES, UNSCORED, and the
  rest: the key-value buckets and the object store `FLYWHEEL_LARGE` are streams too), as bytes;
- the token ids of every recorded turn and trajectory, decoded (a value could hide there only as
  tokens);
- every file under the run directory once the cluster has stopped: nats-server's storage files,
  the gateways' spill files, logs, the ledger, checkpoints, weights.

A *leak* is a string found where its kind's policy says it may not be (`allowed`): anything of
`silent` anywhere; anything of the message holding a `careful` session's personal data; a
`redacting` session's raw value. The control: `open-co`'s values (pii off) must be found on the
streams, on disk and in the tokens, or that scan is blind.

Then, for each answered session whose turns may be kept: its trajectory (lost, truncated,
duplicated, with the consent and end user it should have), its sample, and the trainer's ledger:
every consented one trained exactly once in the weights' lineage, nothing without consent trained
at all (any line of `trained.jsonl`, dead processes' steps included). Counts per tenant and kind.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from flywheel.drills.tenant_load import KINDS, TENANTS, Kind, Session, TenantLoad

PATTERNS = (rb"tdm[0-9a-f]{6}x\d{5}[sp]", rb"pat\.[0-9a-f]{6}x\d{5}@example\.org", rb"4556 \d{4} \d{4} \d{4}",
            rb"4556\d{12}", rb"\(415\) \d{3}-\d{4}")
_REGEXES = tuple(re.compile(p) for p in PATTERNS)
FAILURES = ("leaks", "silent_records", "silent_sessions_registered", "kept_when_dropped", "placeholder_missing",
            "trained_without_consent", "ledger_trained_without_consent", "trained_unkept", "trained_unknown", "lost",
            "truncated", "extra_turns", "duplicated_sessions", "duplicated_trajectories", "duplicated_samples",
            "no_sample", "consent_wrong", "user_wrong", "untrained", "trained_twice", "server_errors", "sessions_failed",
            "unexpected_feedback")
"""The audit's counts that must be 0."""
BY_KIND = {kind.name: kind for kind in KINDS}


def found_in(data: bytes) -> set[str]:
    """Every marker-, e-mail-, card- or phone-shaped string of the drill in `data`."""
    return {m.group().decode() for regex in _REGEXES for m in regex.finditer(data)}


def needles(load: TenantLoad) -> dict[str, tuple[Session, str]]:
    """Each string the audit looks for -> (its session, `marker` | `pii_marker` | `pii`)."""
    out: dict[str, tuple[Session, str]] = {}
    for s in load.sessions.values():
        out[s.marker] = (s, "marker")
        if s.pii_marker:
            out[s.pii_marker] = (s, "pii_marker")
        if s.pii:
            out[s.pii] = (s, "pii")
            if s.pii_type == "CREDIT_CARD":
                out[s.pii.replace(" ", "")] = (s, "pii")
    return out


def allowed(kind: Kind, what: str) -> bool:
    """Whether a string (`marker`, `pii_marker`, `pii`) of a session of this kind may be kept anywhere."""
    if kind.tenant == "silent":
        return False  # store: false
    if kind.pii_fate == "dropped":
        return what == "marker" and kind.pii == "last"  # nothing of the message holding it, nor after
    return not (kind.pii_fate == "redacted" and what == "pii")


def location_of(path: Path, run_dir: Path) -> str:
    rel = path.relative_to(run_dir)
    top = rel.parts[0] if len(rel.parts) > 1 else ""
    if top == "nats":
        return "disk:nats-store"
    if top == "spill":
        return "disk:spill"
    if path.suffix == ".log":
        return "disk:logs"
    return f"disk:{top or rel.name}"


async def scan_bus(bus: Any) -> dict[str, set[str]]:
    """Stream name -> the drill's strings found in its messages' bytes (headers and subjects too)."""
    from nats.js.errors import NotFoundError

    out: dict[str, set[str]] = {}
    for info in await bus.js.streams_info():
        name, seen = info.config.name, set()
        for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
            try:
                raw = await bus.js.get_msg(name, seq)
            except NotFoundError:
                continue
            seen |= found_in(raw.data or b"") | found_in(f"{raw.subject} {raw.headers or {}}".encode())
        out[name] = seen
    return out


def scan_files(run_dir: Path) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Location -> the drill's strings in its files; location -> bytes scanned."""
    out: dict[str, set[str]] = defaultdict(set)
    size: Counter[str] = Counter()
    for path in sorted(run_dir.rglob("*")):
        if path.is_file() and not path.is_symlink():
            where = location_of(path, run_dir)
            data = path.read_bytes()
            size[where] += len(data)
            out[where] |= found_in(data)
    return dict(out), dict(size)


async def read_records(bus: Any) -> dict[str, list[Any]]:
    """The typed records of the streams that hold traffic (TRAFFIC split into turns and events)."""
    from flywheel.bus import SessionEvent, Turn
    from flywheel.bus.scan import stored_records

    out: dict[str, list[Any]] = {"turns": [], "events": [], "trajectories": [], "samples": [], "unscored": []}
    names = {"TRAJECTORIES": "trajectories", "SAMPLES": "samples", "UNSCORED": "unscored"}
    for stream in ("TRAFFIC", *names):
        async for stored in stored_records(bus, stream):
            record = stored.record
            kind = "turns" if isinstance(record, Turn) else "events" if isinstance(record, SessionEvent) else names[stream]
            out[kind].append(record)
    return out


def scan_tokens(records: dict[str, list[Any]], tokenizer: Any) -> set[str]:
    """The drill's strings in the decoded token ids of every turn and trajectory."""
    texts = [tokenizer.decode(list(t.prompt_ids) + list(t.output_ids)) for t in records["turns"]]
    texts += [tokenizer.decode(list(seg.token_ids)) for t in records["trajectories"] for seg in t.segments]
    return found_in("\n".join(texts).encode())


def registered_sessions(kv_subjects: list[tuple[str, bytes]]) -> tuple[Counter[str], set[str]]:
    """Sessions in `FLYWHEEL_SESSIONS` by tenant (the entries' values), and their keys."""
    by_tenant = Counter(value.decode(errors="replace") for _, value in kv_subjects)
    return by_tenant, {subject.rsplit(".", 1)[-1] for subject, _ in kv_subjects}


def unkept_registered(load: TenantLoad, keys: set[str], tenant: str | None = None) -> int:
    """How many sessions whose turns may not be kept (of `tenant`, or any) are in the registry."""
    from flywheel.tenants.sessions import session_key

    return sum(1 for s in load.sessions.values() if BY_KIND[s.kind].turns == 0 and tenant in (None, s.tenant)
               and session_key(s.bus_id) in keys)


async def kv_entries(bus: Any) -> list[tuple[str, bytes]]:
    from nats.js.errors import NotFoundError

    try:
        info = await bus.js.stream_info("KV_FLYWHEEL_SESSIONS")
    except NotFoundError:
        return []
    entries = []
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        try:
            raw = await bus.js.get_msg("KV_FLYWHEEL_SESSIONS", seq)
        except NotFoundError:
            continue
        entries.append((raw.subject, raw.data or b""))
    return entries


def leaks(load: TenantLoad, where: dict[str, set[str]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Strings found where their policy forbids them; and the control: for each location, how
    many of open-co's raw values (kept by its policy) were seen there, of how many sent."""
    index = needles(load)
    out = []
    control: dict[str, dict[str, int]] = {}
    sent = {s.pii for s in load.sessions.values() if s.pii and BY_KIND[s.kind].pii_fate == "kept" and s.sid in load.answered}
    for location, strings in sorted(where.items()):
        seen = {index[x][0].pii for x in strings if x in index and index[x][1] == "pii"}
        control[location] = {"seen": len(sent & seen), "sent": len(sent)}
        for string in sorted(strings):
            if string not in index:
                continue
            session, what = index[string]
            if not allowed(BY_KIND[session.kind], what):
                out.append({"session": session.sid, "kind": session.kind, "tenant": session.tenant, "what": what,
                            "pii_type": session.pii_type if what == "pii" else None, "location": location})
    return out, control


def reply_held_pii(session: Session, kind: Kind) -> bool:
    """Whether the detector finds personal data in a reply the agent got, under a tenant whose
    policy drops such a turn (the model's own output: not a loss of the pipeline's making)."""
    from flywheel.privacy import find

    return TENANTS[kind.tenant]["pii"] != "off" and any(find(reply) for reply in session.replies)


def judge_sessions(load: TenantLoad, records: dict[str, list[Any]], ledger: Path) -> dict[str, Counter[str]]:
    """Per kind: what happened to its sessions (trajectories, samples, training), as counts."""
    from flywheel.bus.records import sample_digest
    from flywheel.train.ledger import lineage

    trajectories: dict[str, list[Any]] = defaultdict(list)
    for t in records["trajectories"]:
        trajectories[t.session_id].append(t)
    samples = {s.id: s for s in records["samples"]}
    sample_copies = Counter(s.id for s in records["samples"])
    trained = Counter(d for step in lineage(ledger) for d in step["samples"]) if ledger.exists() else Counter()
    ever = {d for line in (ledger.read_text().splitlines() if ledger.exists() else []) if '"samples"' in line
            for d in json.loads(line)["samples"]}
    by_digest = {sample_digest(s.id): s for s in records["samples"]}
    counts: dict[str, Counter[str]] = {kind.name: Counter() for kind in KINDS}
    for s in load.sessions.values():
        kind, c = BY_KIND[s.kind], counts[s.kind]
        c["sessions"] += 1
        if s.sid not in load.answered:
            c["sessions_failed"] += 1
            continue
        c["answered"] += 1
        found = trajectories.get(s.bus_id, [])
        if kind.turns == 0:
            c["kept_when_dropped"] += bool(found)
            c["trained_unkept"] += sum(1 for t in found if t.id in samples and sample_digest(t.id) in ever)
            continue
        if not found:
            c["lost"] += 1
            c["lost_reply_held_pii"] += reply_held_pii(s, kind)
            continue
        c["duplicated_sessions"] += len(found) > 1
        t = found[0]
        indices = {turn.turn_index for turn in t.turns}
        rewarded = any(e.reward is not None for e in t.feedback)
        c["complete"] += indices == set(range(kind.turns)) and rewarded
        c["truncated"] += not indices >= set(range(kind.turns)) or not rewarded
        c["truncated_reply_held_pii"] += (not indices >= set(range(kind.turns))) and reply_held_pii(s, kind)
        c["extra_turns"] += bool(indices - set(range(kind.turns)))
        c["consent_wrong"] += t.consent != kind.consent
        c["user_wrong"] += t.user_id != s.user or t.tenant != s.tenant
        if kind.pii_fate == "redacted":
            placeholder = f"<{s.pii_type}>"
            c["redacted"] += 1
            c["placeholder_missing"] += not all(placeholder in str(turn.messages[0].get("content")) for turn in t.turns)
        sample = samples.get(t.id)
        if sample is None:
            c["no_sample"] += 1
            continue
        c["samples"] += 1
        c["samples_with_consent"] += sample.consent
        digest = sample_digest(sample.id)
        if kind.consent:
            c["trained"] += trained[digest] > 0
            c["untrained"] += trained[digest] == 0
            c["trained_twice"] += trained[digest] > 1
        else:
            c["trained_without_consent"] += digest in ever
    total = counts["_all"] = Counter()
    total["duplicated_trajectories"] = sum(n - 1 for n in Counter(t.id for t in records["trajectories"]).values())
    total["duplicated_samples"] = sum(n - 1 for n in sample_copies.values())
    total["trained_unknown"] = sum(1 for d in ever if d not in by_digest)
    total["ledger_trained_without_consent"] = sum(1 for d in ever if d in by_digest and not by_digest[d].consent)
    return counts


def per_tenant(load: TenantLoad, records: dict[str, list[Any]], kinds: dict[str, Counter[str]],
               leak_list: list[dict[str, Any]], refused: Counter[str], kv: list[tuple[str, bytes]]) -> dict[str, dict[str, int]]:
    """The per-tenant table: sessions, what the bus holds of them, what was trained, what leaked."""
    from flywheel.bus.records import tenant_of

    registered, keys = registered_sessions(kv)
    out: dict[str, dict[str, int]] = {}
    for tenant in dict.fromkeys(kind.tenant for kind in KINDS):
        row: Counter[str] = Counter()
        for kind in (k for k in KINDS if k.tenant == tenant):
            row.update({k: v for k, v in kinds[kind.name].items()})
            row["expected_trajectories"] += kinds[kind.name]["answered"] if kind.turns else 0
            row["expected_trained"] += kinds[kind.name]["answered"] if kind.trainable else 0
        for name, key in (("turns", "turns_on_bus"), ("events", "events_on_bus"), ("trajectories", "trajectories_on_bus"),
                          ("samples", "samples_on_bus"), ("unscored", "unscored_on_bus")):
            row[key] = sum(1 for r in records[name] if tenant_of(r) == tenant)
        row["trajectories_on_bus_with_consent"] = sum(1 for t in records["trajectories"] if t.tenant == tenant and t.consent)
        row["refused_by_trainer"] = refused[tenant]
        row["sessions_registered"] = registered[tenant]
        row["pii_sessions"] = sum(1 for s in load.sessions.values() if s.tenant == tenant and s.pii)
        dropped = {s.bus_id for s in load.sessions.values() if s.tenant == tenant and BY_KIND[s.kind].turns == 0}
        row["events_of_unkept_sessions"] = sum(1 for e in records["events"] if e.session_id in dropped)
        row["unkept_sessions_registered"] = unkept_registered(load, keys, tenant)
        row["leaks"] = sum(1 for leak in leak_list if leak["tenant"] == tenant)
        out[tenant] = dict(row)
    return out


async def tenant_audit(bus_url: str, load: TenantLoad) -> dict[str, Any]:
    """What the bus holds (run while the cluster is up): records, every stream's strings, the
    sessions registry; `finish_audit` adds the run directory's once it has stopped."""
    from flywheel.bus import Bus

    bus = await Bus.connect(bus_url, name="tenant-audit", ensure_streams=False)
    try:
        records = await read_records(bus)
        streams = await scan_bus(bus)
        kv = await kv_entries(bus)
    finally:
        await bus.close()
    return {"records": records, "streams": streams, "kv": kv}


def finish_audit(run_dir: Path, load: TenantLoad, bus_view: dict[str, Any]) -> dict[str, Any]:
    """The report, from what the bus held and the run directory (the cluster stopped)."""
    from transformers import AutoTokenizer

    from flywheel.models import build_tiny

    records = bus_view["records"]
    where = {f"stream:{name}": strings for name, strings in bus_view["streams"].items()}
    files, sizes = scan_files(run_dir)
    where.update(files)
    where["tokens"] = scan_tokens(records, AutoTokenizer.from_pretrained(build_tiny(0)))
    leak_list, control = leaks(load, where)
    kinds = judge_sessions(load, records, run_dir / "trained.jsonl")
    train_log = run_dir / "train.log"
    refused = Counter(re.findall(r"refused sample \S+ of tenant (\S+):", train_log.read_text())) if train_log.exists() else Counter()
    tenants = per_tenant(load, records, kinds, leak_list, refused, bus_view["kv"])
    totals: Counter[str] = Counter()
    for c in kinds.values():
        totals.update(c)
    silent_records = sum(1 for name in ("turns", "events", "trajectories", "samples", "unscored") for r in records[name]
                         if getattr(r, "tenant", None) == "silent" or getattr(r, "session_id", "").startswith("silent/"))
    report = {
        "tag": load.tag, "sessions": len(load.sessions), "sessions_answered": len(load.answered),
        "requests": load.requests, "requests_unanswered": load.sent - load.requests, "server_errors": load.server_errors, "unexpected_feedback": load.unexpected_feedback,
        "leaks": len(leak_list), "leak_examples": leak_list[:20],
        "silent_records": silent_records, "silent_sessions_registered": tenants["silent"]["unkept_sessions_registered"],
        "bytes_scanned": sizes,
        "not_there": [loc for loc in ("disk:spill", "stream:OBJ_FLYWHEEL_LARGE") if loc not in where],
        "control": {loc: f"{c['seen']}/{c['sent']}" for loc, c in control.items()},
        "tenants": tenants,
        "kinds": {name: dict(c) for name, c in kinds.items() if name != "_all"},
        "failed_examples": dict(list(load.failed.items())[:5]),
    }
    for key in FAILURES:
        if key not in report:
            report[key] = totals[key]
    return report
