"""The promotion loop: weight announcements in, promotions out (`promotion.mode` gate or canary).

A fifth loop beside serve, collect, judge and train, which it never imports: it reads the bus
(WEIGHTS, SAMPLES, operators' VERSION_COMMANDS) and writes the version registry
(`flywheel/versions/registry.py`), the only writer of it. Gateways follow the registry's routing, the trainer
its directive; the four loops run as before.

- Each announced version is registered as a candidate, with its lineage; one that descends from
  a rejected or rolled-back version (trained before the trainer heard) is rejected (`lineage`).
  With `adapters.kind: lora` the versions are those of the shared and tenant adapters, each
  adapter a line of its own (an end user's own adapter is published straight to its user,
  guarded by the trainer: `flywheel/train/adapter_guard.py`).
- The newest candidate of a line is evaluated (`flywheel/promote/gate.py`) against the line's
  serving version; older candidates retire unevaluated (superseded); of several lines, the one
  evaluated longest ago goes first. Nothing of a line is evaluated while its canary runs or while
  an operator has pinned it, nor anything while a traffic suite has too few recorded prompts (the
  candidate's entry says why: `waiting`; looked at again as turns are recorded).
- Passed: mode `gate` serves it; mode `canary` gives it `promotion.canary.share` of its line's new
  sessions until the sequential test (`flywheel/promote/sequential.py`) on the arms' judged
  sessions promotes it or rolls it back (`promotion.canary.max_minutes`: rolled back if still
  undecided then); each line's canary on its own.
- Rejected or rolled back: the trainer is told to continue from the serving version
  (`promotion.continue_from`).
- Operators' commands (`flywheel versions`, the gateway's admin routes), on any line, are carried
  out in order, and each one's result is written back (`flywheel/promote/commands.py`).
- A forgotten tenant's adapter leaves the registry and the routing (`Decisions.forget`).

Everything it decides is in the registry before the bus messages that caused it are
acknowledged, so a promoter killed at any point comes back to the same registry and decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from flywheel.bus import (
    SAMPLE_SUBJECT,
    TURN_SUBJECT,
    WEIGHTS_SUBJECT,
    Bus,
    Turn,
    WeightUpdate,
)
from flywheel.bus.records import AuditEntry
from flywheel.bus.restart_barrier import RestartBarrier
from flywheel.bus.streams import AUDIT_SUBJECT, COMMANDS_SUBJECT
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.tenants import retention_s
from flywheel.models import load_model
from flywheel.models.adapter_names import is_personal
from flywheel.promote.commands import carry_out
from flywheel.promote.decisions import Decisions
from flywheel.promote.evidence import (
    add_online,
    add_turn,
    by_version,
    operations_verdict,
    turn_version,
)
from flywheel.promote.gate import EvalServer, Gate
from flywheel.promote.sequential import SequentialTest
from flywheel.promote.states import IllegalTransition, move
from flywheel.running_stats import RunningStats
from flywheel.runtime import cancel_and_wait, repeat
from flywheel.versions.records import (
    FOUND_WORSE,
    Arm,
    CommandResult,
    Routing,
    Transition,
    VersionCommand,
    VersionEntry,
)
from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)
RETRY_S = 10.0
LOOK_AGAIN_S = 2.0
"""A gate waiting for recorded prompts looks again once turns have come, at most this often."""


class PromoteLoop:
    def __init__(self, config: FlywheelConfig, bus_url: str):
        self.config = config
        self.bus_url = bus_url
        self.counts = {"registered": 0, "evaluated": 0, "rejected": 0, "promoted": 0, "rolled_back": 0, "commands": 0}
        self._wake = asyncio.Event()
        self._waiting_since: float | None = None
        """When the gate last found a traffic suite short of recorded prompts (None: not waiting)."""
        self._turns_since = 0
        self._forgotten: dict[str, float] = {}  # when each tenant was last forgotten (older announcements: not registered)
        self._evaluated_at: dict[str | None, float] = {}
        """When each line (None: the shared weights; else an adapter) last had a version evaluated."""
        self._tasks: list[asyncio.Task] = []
        self._barrier = RestartBarrier(0, 0, 0.0)  # open, until `start` reads what a predecessor left
        p = config.promotion.canary
        self.test = SequentialTest(p.delta, p.alpha, p.beta, p.min_sessions, p.max_sessions, p.variance_floor)

    async def start(self) -> None:
        url = self.config.promotion.eval_url
        if not self.config.promotion.enabled or not url:
            raise ConfigError("promotion.eval_url: the promotion loop needs promotion.mode on and an evaluation server "
                              "(deploy starts one and sets it; by hand: flywheel serve serve.role=eval)")
        self.bus = await Bus.connect(self.bus_url, name="promote", replicas=self.config.bus.replicas,
                                  retention=retention_s(self.config.tenants))
        self.registry = await Registry.open(self.bus)
        self.decisions = Decisions(self.registry, self.config)
        async with self.decisions.lock:
            await self._first_start()
            await self.decisions.repair()
        _, tokenizer = await asyncio.to_thread(load_model, self.config.model)
        key = self.config.serve.admin_key or next(iter(self.config.serve.api_keys), None)  # tenants' keys: the admin's
        self.gate = Gate(self.config, tokenizer, EvalServer(url, key, self.config.promotion.gate.timeout_s), self.bus)
        self.samples = self.bus.consumer(SAMPLE_SUBJECT, "promote", ack_wait_s=self.config.bus.ack_wait_s)
        self._barrier = await RestartBarrier.of(self.samples, self.config.bus.ack_wait_s)  # a predecessor's first
        self.turns = self.bus.consumer(TURN_SUBJECT, "promote-turns", ack_wait_s=self.config.bus.ack_wait_s)
        self.commands = self.bus.consumer(COMMANDS_SUBJECT, "promote-commands")
        self._tasks = [asyncio.create_task(repeat(fn, f"promote.{name}"), name=name) for name, fn in (
            ("weights", self._follow_weights), ("evaluate", self._evaluate_forever), ("evidence", self._evidence),
            ("operations", self._operations), ("commands", self._commands), ("forget", self._follow_forgetting))]
        self._wake.set()

    async def _first_start(self) -> None:
        """Version 0 (the weights serving started with) serves, unless the registry says otherwise."""
        if await self.registry.get(0) is None:
            await self.registry.put(VersionEntry(id="v0", version=0, path=None, state="serving", transitions=[
                Transition(state="serving", reason="the weights serving started with", by="promoter")]))
        if await self.registry.routing() is None:
            await self.registry.set_routing(Routing(id="routing-initial", serving=Arm(version=0, path=None),
                                                    reason="the weights serving started with"))

    async def _follow_weights(self) -> None:
        async for update in self.bus.follow(WEIGHTS_SUBJECT, from_first=True):  # registered once each
            assert isinstance(update, WeightUpdate)
            async with self.decisions.lock:
                await self._register(update)
            self._wake.set()

    async def _register(self, update: WeightUpdate) -> None:
        if update.adapter is not None and (is_personal(update.adapter) or update.created_at < self._forgotten.get(update.adapter, 0)):
            return  # an end user's own adapter (its user's alone), or a tenant's forgotten since
        if await self.registry.get(update.version, update.adapter) is not None:
            return  # announced again (a restarted trainer), or seen before this promoter restarted
        name = f"v{update.version}" if update.adapter is None else f"{update.adapter}@v{update.version}"
        entry = VersionEntry(id=name, version=update.version, path=update.path, parent=update.parent, adapter=update.adapter,
                             step=update.step, trained_on=update.trained_on, config=update.config, metrics=update.metrics,
                             transitions=[Transition(state="candidate", reason="announced by the trainer", by="trainer",
                                                     at=update.created_at)])
        self.counts["registered"] += 1
        await self.registry.put(await self._lineage_checked(entry))

    async def _lineage_checked(self, entry: VersionEntry) -> VersionEntry:
        """`entry`, rejected (`lineage`) if it descends from a version that was rejected or rolled
        back. Checked when it is announced, and again before and after its evaluation: its parent
        may be rejected after it was announced (the trainer trains on while a candidate is
        evaluated), and a version that served from such a line was one the trainer abandoned."""
        parent = await self.registry.get(entry.parent, entry.adapter) if entry.parent is not None else None
        while parent is not None and not parent.served and parent.state == "retired" and parent.parent is not None:
            parent = await self.registry.get(parent.parent, parent.adapter)  # superseded ancestors say nothing; look further up
        if parent is None or parent.state not in FOUND_WORSE:
            return entry
        self.counts["rejected"] += 1
        return move(entry, "rejected", f"descends from {parent.id}, which was {parent.state.replace('_', ' ')}", "lineage")

    async def _newest_candidate(self) -> VersionEntry | None:
        """Under the lock: the newest candidate of the line evaluated longest ago that has one (its
        older ones retire), unless nothing may be evaluated now."""
        routing = await self.decisions.routing()
        lines = [line for line in [None, *await self.registry.adapters()] if not _held(routing, line)]
        for line in sorted(lines, key=lambda line: self._evaluated_at.get(line, 0.0)):
            candidates = [e for e in await self.registry.versions(adapter=line) if e.state == "candidate"]
            if candidates:
                newest = candidates[-1]
                for older in candidates[:-1]:
                    await self.registry.put(move(older, "retired", f"superseded by {newest.id} before evaluation", "promoter"))
                return newest
        return None

    async def _begin(self, candidate: VersionEntry, waiting: str | None) -> tuple[VersionEntry, VersionEntry] | None:
        """Under the lock: the candidate moved to evaluating, and its line's serving version; None
        when it is no longer to be evaluated, or when the gate is `waiting` (the reason kept in
        its entry's `waiting`)."""
        entry, routing = await self.decisions.entry(candidate.version, candidate.adapter), await self.decisions.routing()
        if entry.state != "candidate" or _held(routing, entry.adapter):
            return None
        if (entry := await self._lineage_checked(entry)).state == "rejected":
            await self.registry.put(entry)
            return None
        if waiting is not None:
            if entry.waiting != waiting:
                log.info("%s waits: %s", entry.id, waiting)
                entry.waiting = waiting
                await self.registry.put(entry)
            return None
        serving = await self.decisions.serving(entry.adapter)
        entry = move(entry, "evaluating", f"compared with the serving {serving.id}", "promoter")
        await self.registry.put(entry)
        self._evaluated_at[entry.adapter] = time.monotonic()
        return entry, serving

    async def _evaluate_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                async with self.decisions.lock:
                    newest = await self._newest_candidate()
                if newest is None:
                    break
                waiting = await self.gate.prepare()  # reads recorded traffic: outside the lock
                async with self.decisions.lock:
                    work = await self._begin(newest, waiting)
                if waiting is not None:  # a traffic suite short of recorded prompts: `_operations` wakes it when turns come
                    self._waiting_since, self._turns_since = time.monotonic(), 0
                if work is None:
                    break
                await self._evaluate(*work)

    async def _evaluate(self, candidate: VersionEntry, serving: VersionEntry) -> None:
        try:
            report = await asyncio.wait_for(self.gate.evaluate(candidate, serving), self.config.promotion.gate.timeout_s)
        except Exception as exc:  # the evaluation server away, a timeout: try again later
            log.warning("evaluation of %s failed (%s); retrying in %.0f s", candidate.id, exc, RETRY_S)
            async with self.decisions.lock:
                entry = await self.decisions.entry(candidate.version, candidate.adapter)
                if entry.state == "evaluating":
                    await self.registry.put(move(entry, "candidate", f"evaluation failed: {exc}", "promoter"))
            await asyncio.sleep(RETRY_S)
            self._wake.set()
            return
        self.counts["evaluated"] += 1
        async with self.decisions.lock:
            entry = await self.decisions.entry(candidate.version, candidate.adapter)
            if entry.state != "evaluating":
                return  # an operator decided meanwhile
            entry.gate = report
            if (entry := await self._lineage_checked(entry)).state == "rejected":
                await self.registry.put(entry)
                return
            said = f"gate against {serving.id}"
            if not report["passed"]:
                self.counts["rejected"] += 1
                await self.decisions.reject(entry, "rejected", f"{said}: " + "; ".join(report["reasons"]), "gate")
            elif self.config.promotion.mode == "canary":
                await self.decisions.start_canary(entry, f"{said}: passed")
            else:
                self.counts["promoted"] += 1
                await self.decisions.serve(entry, f"{said}: passed", "gate")

    async def _evidence(self) -> None:
        """Apply judged samples in stream order (`applied_seq`, `online_seq` rely on it): a dead
        predecessor's first (`RestartBarrier`); a fetch not applied handed back, to come first."""
        deliveries = self._barrier.hold(await self.samples.fetch(batch=256, timeout_s=1.0))
        if deliveries:
            try:
                found = await asyncio.gather(*(self.bus.resolve(d.record) for d in deliveries), return_exceptions=True)
                usable = [d for d, ok in zip(deliveries, found) if ok is True]
                async with self.decisions.lock:
                    await self._apply(by_version(usable))
            except Exception:
                await asyncio.gather(*(d.nak() for d in deliveries), return_exceptions=True)
                raise
            for delivery in deliveries:
                with contextlib.suppress(Exception):
                    await delivery.ack()
        async with self.decisions.lock:
            await self._decide_canary()

    async def _apply(self, rewards: dict[tuple[str | None, int], list[tuple[int, float]]]) -> None:
        routing = await self.decisions.routing()
        applied: dict[str | None, int] = {}  # each canary's watermark before this fetch: both arms' groups are read against it
        for (adapter, version), seen in rewards.items():
            entry = await self.registry.get(version, adapter)  # an adapter's start (version 0) has none
            if entry is not None and add_online(entry, seen):  # before the arms: a canary's evidence implies its online rows
                await self.registry.put(entry)
            canary = routing.canary_of(adapter)
            arms = {canary.version: "canary_arm", routing.serving_version(adapter): "serving_arm"} if canary else {}
            if version in arms:  # while a canary runs, both arms' state lives in the canary's entry
                holder = await self.decisions.entry(canary.version, adapter)
                state = holder.canary
                stats = RunningStats.from_dict(state[arms[version]])
                start = applied.setdefault(adapter, state["applied_seq"])
                fresh = [(seq, r) for seq, r in seen if seq > start]
                for _, reward in fresh:
                    stats.add(reward)
                state[arms[version]] = stats.as_dict()
                state["applied_seq"] = max([state["applied_seq"], *(seq for seq, _ in fresh)])
                await self.registry.put(holder)

    async def _operations(self) -> None:
        deliveries = await self.turns.fetch(batch=256, timeout_s=1.0)
        self._turns_since += len(deliveries)
        if self._waiting_since is not None and self._turns_since and time.monotonic() - self._waiting_since >= LOOK_AGAIN_S:
            self._waiting_since = None  # the gate waits for recorded prompts, and turns were recorded since it looked
            self._wake.set()
        async with self.decisions.lock:
            routing = await self.decisions.routing()
            holders: dict[str | None, VersionEntry] = {}
            for delivery in deliveries:
                turn = delivery.record
                canary = routing.canary_of(turn.adapter) if isinstance(turn, Turn) else None
                if canary is None:
                    continue
                if turn.adapter not in holders:
                    holders[turn.adapter] = await self.decisions.entry(canary.version, turn.adapter)
                state = holders[turn.adapter].canary
                arms = {canary.version: "canary_ops", routing.serving_version(turn.adapter): "serving_ops"}
                if turn_version(turn) in arms and delivery.stream_seq > state["applied_turn_seq"]:
                    add_turn(state[arms[turn_version(turn)]], turn)
                    state["applied_turn_seq"] = delivery.stream_seq
            for holder in holders.values():
                await self.registry.put(holder)
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.ack()

    async def _decide_canary(self) -> None:
        routing = await self.decisions.routing()
        for adapter in [None, *routing.adapter_canaries]:
            if (canary := routing.canary_of(adapter)) is not None:
                await self._decide(await self.decisions.entry(canary.version, adapter))

    async def _decide(self, entry: VersionEntry) -> None:
        """Promote the canary `entry`, roll it back, or keep it on (its state updated)."""
        state = entry.canary or {}
        decision = self.test.decide(RunningStats.from_dict(state["canary_arm"]), RunningStats.from_dict(state["serving_arm"]))
        state["decision"] = decision.reason
        limit = self.config.promotion.canary.max_minutes
        operations = operations_verdict(state["canary_ops"], state["serving_ops"], self.config.promotion.canary)
        if operations is not None:
            decision_reason, verdict = operations, "rollback"
        elif decision.verdict is None and limit is not None and time.time() - state["started"] > limit * 60:
            decision_reason, verdict = f"{decision.reason}; still undecided after {limit} minutes", "rollback"
        else:
            decision_reason, verdict = decision.reason, decision.verdict
        if verdict == "promote":
            self.counts["promoted"] += 1
            await self.decisions.serve(entry, decision_reason, "canary")
            self._wake.set()
        elif verdict == "rollback":
            self.counts["rolled_back"] += 1
            await self.decisions.reject(entry, "rolled_back", decision_reason, "canary")
            self._wake.set()
        else:
            await self.registry.put(entry)

    async def _follow_forgetting(self) -> None:  # a forgotten tenant's adapter leaves the registry (`Decisions.forget`)
        async for entry in self.bus.follow(AUDIT_SUBJECT, from_first=True):  # again after a restart: none missed
            if isinstance(entry, AuditEntry) and entry.action == "forget" and entry.details.get("user") is None:
                self._forgotten[entry.details["tenant"]] = entry.created_at
                async with self.decisions.lock:
                    await self.decisions.forget(entry.details["tenant"], entry.created_at)
                self._wake.set()  # an evaluation it cut short looks again

    async def _commands(self) -> None:
        for delivery in await self.commands.fetch(batch=16, timeout_s=1.0):
            command: VersionCommand = delivery.record  # type: ignore[assignment]
            async with self.decisions.lock:
                if await self.registry.result(command.id) is None:  # not carried out before a restart
                    try:
                        message = await carry_out(self.decisions, command)
                        result = CommandResult(id=command.id, ok=True, message=message)
                    except (LookupError, IllegalTransition, ValueError) as exc:
                        result = CommandResult(id=command.id, ok=False, message=str(exc))
                    await self.registry.set_result(result)
                    await self.bus.publish(AUDIT_SUBJECT, AuditEntry(
                        id=f"command-{command.id}", actor=command.operator, action=f"version.{command.kind}",
                        target=("" if command.version is None else f"v{command.version}")
                        + (f" of {command.adapter}" if command.adapter else ""),
                        details={"ok": result.ok, "message": result.message, "reason": command.reason}))
                    self.counts["commands"] += 1
            await delivery.ack()
            self._wake.set()

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if hasattr(self, "samples"):  # what it held comes back first, now, to its successor
            await self.samples.hand_back(self._barrier.held)
        if hasattr(self, "gate"):
            await self.gate.close()
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        return dict(self.counts)


def _held(routing: Routing, line: str | None) -> bool:
    """Whether nothing of `line` (None: the shared weights) may be evaluated now: an operator
    pinned it, or its canary runs."""
    pinned = routing.pinned if line is None else line in routing.pinned_adapters
    return pinned or routing.canary_of(line) is not None
