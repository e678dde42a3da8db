"""The promotion loop's changes to the registry: who serves, and what the trainer continues from.

Every change goes through here, under one lock (the promoter is the registry's single writer,
but its gate, canary and command tasks run side by side), and every version's state moves only
through `flywheel.promote.states.move`, so each change is recorded with its reason and its decider.
Routing is written after the versions' states, so a gateway never follows a routing whose
versions the registry does not show in those states for long (a crash in between is repaired
at the next start: `repair`).

A shared or tenant adapter's versions (`VersionEntry.adapter`) are a line of their own: one of
them serves (`Routing.adapters`; before any has, the adapter's start, version 0: the bare base),
one may be on canary (`Routing.adapter_canaries`), and a rejected or rolled-back one sends the
trainer back to the one serving (a `TrainerDirective` about that adapter).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from flywheel.config import FlywheelConfig
from flywheel.models.adapter_store import owned_by
from flywheel.promote.evidence import new_operations
from flywheel.promote.states import move
from flywheel.versions.records import (
    FOUND_WORSE,
    Arm,
    Routing,
    TrainerDirective,
    VersionEntry,
)
from flywheel.versions.registry import Registry


def arm(entry: VersionEntry) -> Arm:
    return Arm(version=entry.version, path=entry.path)


def adapter_start(adapter: str) -> VersionEntry:
    """Version 0 of `adapter`, what serves before any of its versions has: the bare base."""
    return VersionEntry(id=f"{adapter}@v0", version=0, path=None, adapter=adapter, state="serving")


class Decisions:
    def __init__(self, registry: Registry, config: FlywheelConfig):
        self.registry = registry
        self.config = config
        self.lock = asyncio.Lock()

    async def routing(self) -> Routing:
        routing = await self.registry.routing()
        assert routing is not None, "the promoter writes a routing at its first start"
        return routing

    async def entry(self, version: int, adapter: str | None = None) -> VersionEntry:
        entry = await self.registry.get(version, adapter)
        if entry is None and adapter is not None and version == 0:
            return adapter_start(adapter)
        if entry is None:
            raise LookupError(f"no version {version} {'of ' + adapter + ' ' if adapter else ''}in the registry")
        return entry

    async def serving(self, adapter: str | None = None) -> VersionEntry:
        """The version that serves the line: the shared weights', or `adapter`'s (its start before
        any of its versions has)."""
        routing = await self.routing()
        if adapter is None:
            return await self.entry(routing.serving.version)
        serving = routing.adapters.get(adapter)
        return await self.entry(serving.version if serving else 0, adapter)

    async def set_routing(self, routing: Routing, reason: str, **changes) -> None:
        fields = {"serving": routing.serving, "canary": routing.canary, "canary_share": routing.canary_share,
                  "pinned": routing.pinned, "adapters": routing.adapters, "pinned_adapters": routing.pinned_adapters,
                  "adapter_canaries": routing.adapter_canaries, **changes}
        if fields["canary"] is None and not fields["adapter_canaries"]:
            fields["canary_share"] = 0.0
        await self.registry.set_routing(Routing(id=f"routing-{uuid.uuid4().hex[:12]}", reason=reason, **fields))

    async def serve(self, entry: VersionEntry, reason: str, by: str) -> None:
        """`entry` serves its line (the shared weights', or its adapter's requests); the version
        serving before retires (a canary other than `entry` retires too: it was not chosen)."""
        routing = await self.routing()
        line, canary = entry.adapter, routing.canary_of(entry.adapter)
        for old in {routing.serving_version(line), *([canary.version] if canary else [])} - {entry.version}:
            previous = await self.entry(old, line)
            if previous.state in ("serving", "canary") and not _is_start(previous):
                await self.registry.put(move(previous, "retired", f"{entry.id} serves instead", by))
        if not _is_start(entry):  # an adapter's start (the bare base) is no entry: it serves where the routing names none
            await self.registry.put(move(entry, "serving", reason, by))
        if line is None:
            await self.set_routing(routing, f"{entry.id}: {reason}", serving=arm(entry), canary=None)
            return
        adapters = _without(routing.adapters, line) | ({} if _is_start(entry) else {line: arm(entry)})
        await self.set_routing(routing, f"{entry.id}: {reason}", adapters=adapters,
                               adapter_canaries=_without(routing.adapter_canaries, line))

    async def start_canary(self, entry: VersionEntry, reason: str) -> None:
        """`entry` gets `promotion.canary.share` of its line's new sessions; the evidence of both
        arms is kept in its entry (`canary`) until the test decides."""
        routing = await self.routing()
        share = self.config.promotion.canary.share
        entry.canary = {"started": time.time(), "share": share, "serving": routing.serving_version(entry.adapter),
                        "canary_arm": {"n": 0, "mean": 0.0, "m2": 0.0}, "serving_arm": {"n": 0, "mean": 0.0, "m2": 0.0},
                        "applied_seq": 0, "canary_ops": new_operations(), "serving_ops": new_operations(),
                        "applied_turn_seq": 0, "decision": None}
        await self.registry.put(move(entry, "canary", reason, "gate"))
        line = {"canary": arm(entry)} if entry.adapter is None else {
            "adapter_canaries": {**routing.adapter_canaries, entry.adapter: arm(entry)}}
        await self.set_routing(routing, f"{entry.id} is canary for {share:.0%} of new sessions", canary_share=share, **line)

    async def reject(self, entry: VersionEntry, state: str, reason: str, by: str) -> None:
        """`entry`, a candidate the gate turned down or its line's canary, is rejected (never served)
        or rolled back; a canary ends. The trainer is told to continue from what serves (a promoter
        that dies before that: `repair` writes the directive). Rolling back the version that serves
        is an operator's command (`flywheel.promote.commands`)."""
        line, said = entry.adapter, state.replace("_", " ")
        await self.registry.put(move(entry, state, reason, by))  # type: ignore[arg-type]
        routing = await self.routing()
        canary = routing.canary_of(line)
        if canary is not None and canary.version == entry.version:
            ended = {"canary": None} if line is None else {"adapter_canaries": _without(routing.adapter_canaries, line)}
            await self.set_routing(routing, f"{entry.id}: {reason}", **ended)
        await self.direct_trainer(await self.serving(line), entry.version, f"{entry.id} {said}: {reason}")

    async def direct_trainer(self, good: VersionEntry, rejected: int, reason: str) -> None:
        """Tell the trainer to continue from `good`, `rejected` having been found worse
        (`promotion.continue_from: last_good`)."""
        if self.config.promotion.continue_from != "last_good":
            return
        await self.registry.set_directive(TrainerDirective(
            id=f"directive-{uuid.uuid4().hex[:12]}", version=good.version, path=good.path, abandon_after=good.version,
            reason=reason, rejected=rejected, adapter=good.adapter))

    async def forget(self, tenant: str, at: float) -> None:
        """`tenant` was forgotten at `at`: its adapter's versions announced before then leave the
        registry, and the routing, and so does the trainer's directive about a line that is all
        gone: a tenant made again under that name starts a new line (its numbers from 1 again)
        that the gate sees afresh. Versions announced after `at` stay (the forget read again
        after a restart of the promoter)."""
        routing = await self.routing()
        for name in owned_by(await self.registry.adapters(), tenant, None):
            line = await self.registry.versions(adapter=name)
            gone = [e for e in line if e.transitions and e.transitions[0].at < at]
            routed = [arm for arm in (routing.adapters.get(name), routing.adapter_canaries.get(name)) if arm]
            if any(e.version == arm.version for e in gone for arm in routed):  # first: a purged line is not listed again
                await self.set_routing(routing, f"tenant {tenant} forgotten", adapters=_without(routing.adapters, name),
                                       adapter_canaries=_without(routing.adapter_canaries, name))
                routing = await self.routing()
            if len(gone) == len(line):
                await self.registry.purge_directive(name)
                if name in routing.pinned_adapters:
                    await self.set_routing(routing, f"tenant {tenant} forgotten",
                                           pinned_adapters=[a for a in routing.pinned_adapters if a != name])
                    routing = await self.routing()
            for entry in gone:
                await self.registry.purge(entry)

    async def repair(self) -> None:
        """After a restart: an evaluation cut short goes back to candidate; the routing names the
        versions the registry has serving and on canary, each adapter's too, and no canary the
        registry shows decided; an adapter's rejection or rollback whose directive was not written
        gets it."""
        routing = await self.routing()
        shared = await self.registry.versions()
        lines = [await self.registry.versions(adapter=adapter) for adapter in await self.registry.adapters()]
        for entry in [e for line in (shared, *lines) for e in line if e.state == "evaluating"]:
            await self.registry.put(move(entry, "candidate", "the promoter restarted during its evaluation", "promoter"))
        serving = {e.adapter: arm(e) for line in lines for e in line if e.state == "serving" and e.adapter}  # each line's newest
        canaries = {e.adapter: arm(e) for line in lines for e in line if e.state == "canary" and e.adapter}
        if any(routing.adapters.get(name) != served for name, served in serving.items()) or any(
                routing.adapter_canaries.get(name) != canary for name, canary in canaries.items()):
            await self.set_routing(routing, "adapters restored after a restart", adapters={**routing.adapters, **serving},
                                   adapter_canaries={**routing.adapter_canaries, **canaries},
                                   canary_share=self.config.promotion.canary.share if canaries else routing.canary_share)
            routing = await self.routing()
        for line in lines:  # a rejection whose directive a dead promoter did not write
            worse = [e for e in line if e.state in FOUND_WORSE and e.transitions and e.transitions[-1].by != "lineage"]
            directive = await self.registry.directive(line[0].adapter) if worse else None
            if worse and (directive is None or (directive.rejected or 0) < worse[-1].version):
                await self.direct_trainer(await self.serving(str(line[0].adapter)), worse[-1].version,
                                          f"{worse[-1].id} {worse[-1].state.replace('_', ' ')}: {worse[-1].transitions[-1].reason}")
        for entry in shared:
            if entry.state == "canary" and (routing.canary is None or routing.canary.version != entry.version):
                await self.set_routing(routing, "restored after a restart", canary=arm(entry),
                                       canary_share=(entry.canary or {}).get("share", self.config.promotion.canary.share))
                routing = await self.routing()
        ended = [line for line in [None, *routing.adapter_canaries] if (canary := routing.canary_of(line)) is not None
                 and getattr(await self.registry.get(canary.version, line), "state", None) != "canary"]
        if ended:  # decided (or forgotten) before the routing was written
            await self.set_routing(routing, "ended canaries removed after a restart",
                                   canary=None if None in ended else routing.canary,
                                   adapter_canaries={k: v for k, v in routing.adapter_canaries.items() if k not in ended})


def _is_start(entry: VersionEntry) -> bool:
    """Whether `entry` is an adapter's start (`adapter_start`), which the registry does not hold."""
    return entry.adapter is not None and entry.version == 0


def _without(arms: dict[str, Arm], name: str) -> dict[str, Arm]:
    return {other: routed for other, routed in arms.items() if other != name}
