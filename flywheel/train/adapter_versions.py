"""Each adapter's versions (`adapters.kind: lora`): staleness, publishing, and restarts.

Versions count per adapter, as the trainer's version counts for the shared weights: an adapter's
initial state is version 0 and each training step of it makes the next (so with
`train.weight_update_interval` 1 its first published version is 1). A sample's staleness is its
adapter's version minus the oldest version among its tokens (`Turn.output_versions` of an
adapter's turns are that adapter's versions).

Every `train.weight_update_interval` steps of an adapter, that adapter alone is published to the
adapter store (flywheel/models/adapter_store.py) and announced on WEIGHTS as a
`WeightUpdate(adapter=name, version=N, path=...)`. Versions only grow: a trainer restarted from a
checkpoint behind what it had published gives such an adapter a new version above its newest in
the store, and announces it. A forgotten adapter (`drop`) starts again from version 0; an
announcement's id names the step too, so the bus does not take a new adapter's version 1 for a
repeat of the forgotten one's (JetStream drops a message whose id it saw in its duplicate window).

With a guard (`adapters.guard_drop`, `guard_answers`, flywheel/train/adapter_guard.py) a
version that forgot too much general skill, or whose replies stopped answering the question, is
held back instead: not published, and the adapter back to its last published version
(`hold_back`). Each way back is written in the ledger (`Ledger.back_to`). The guard asks its
questions after the system messages of the last conversation the adapter trained on (`stepped`).

Under promotion (`promotion.mode: gate`) each shared or tenant adapter is a line of the version
registry (`UnderPromotion`, flywheel/train/under_promotion.py): before each step
`follow_registry` carries out its directives (a rejected version: the adapter back to the one
that serves, fresh moments, its versions since abandoned; its versions keep counting up, so no
number names two weights), its staleness is counted in updates on its line, and it takes a step
only while at most max(η, 1) updates ahead of its serving version (`may_train`); its serving
version is never pruned from the store. An end user's own adapter is published to its user as
it is made, and an operator may take it back to an earlier version (`roll_back`,
flywheel/versions/adapter_rollback.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file

from flywheel.bus import WEIGHTS_SUBJECT, Bus, Sample, WeightUpdate
from flywheel.bus.records import sample_digest
from flywheel.models.adapter_names import is_personal, origin, sample_adapter
from flywheel.models.adapter_store import AdapterStore
from flywheel.models.lora_adapter import WEIGHTS_FILE
from flywheel.tenants.forgotten import forgets
from flywheel.train.adapter_guard import GENERAL_PROMPTS, RELEVANCE_PROMPTS, AdapterGuard, Context, context_of
from flywheel.train.adapters import AdapterSet
from flywheel.train.ledger import Ledger
from flywheel.train.under_promotion import UnderPromotion

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig
    from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)


class AdapterVersions:
    def __init__(self, store: AdapterStore, bus: Bus, interval: int, guard: AdapterGuard | None = None,
                 origin_of: Callable[[str], str | None] = lambda name: None, registry: Registry | None = None,
                 max_ahead: int = 1, ledger: Ledger | None = None):
        self.store = store
        self.bus = bus
        self.interval = interval
        self.guard = guard
        self.origin_of = origin_of
        self.registry = registry
        self.max_ahead = max_ahead
        self.ledger = ledger
        self.lines: dict[str, UnderPromotion] = {}
        """The registry line of each shared or tenant adapter, under promotion."""
        self.versions: dict[str, int] = {}
        """Each adapter's current version (0 when absent: the initial state)."""
        self.parents: dict[str, int] = {}
        """Each adapter's version last announced (its next version's parent)."""
        self.contexts: dict[str, tuple[str, str | None, Context]] = {}
        """The system messages the last conversation each adapter trained on began with, and whose it
        was (tenant, user): where the guard asks its questions (in memory only; `forget`)."""

    @classmethod
    def of(cls, config: FlywheelConfig, run_dir: Path, bus: Bus, adapters: AdapterSet, tokenizer: Any,
           registry: Registry | None = None, ledger: Ledger | None = None) -> AdapterVersions:
        """A run's: its store (`run_dir/adapters`), its guard (`adapters.guard_drop`, `guard_answers`
        and their prompts), its adapters' origins, the version registry when versions must earn
        their traffic, and its ledger."""
        store = AdapterStore(run_dir / "adapters", keep=config.train.keep_versions)
        checks = config.adapters
        guard = None
        if (checks.guard_drop, checks.guard_answers) != (None, None):
            guard = AdapterGuard(adapters, tokenizer, checks.guard_drop, checks.guard_answers,
                                 prompts=tuple(checks.guard_prompts or GENERAL_PROMPTS),
                                 questions=tuple(checks.guard_questions or RELEVANCE_PROMPTS))
        return cls(store, bus, config.train.weight_update_interval, guard, lambda name: origin(name, config),
                   registry, config.rollout.max_head_offpolicyness, ledger)

    def _line(self, name: str) -> UnderPromotion | None:
        if self.registry is None or is_personal(name):
            return None
        if name not in self.lines:
            self.lines[name] = UnderPromotion(self.registry, self.max_ahead, adapter=name)
        return self.lines[name]

    async def follow_registry(self, adapters: AdapterSet) -> bool:
        """Under promotion, before a step (and before a restarted trainer publishes anything):
        each shared or tenant adapter's serving version read and kept from pruning, and a new
        directive about it carried out (see the module docstring); whether one was (carried out
        or passed over: the trainer checkpoints, so that it is not carried out again)."""
        directed = False
        routing = await self.registry.routing() if self.registry is not None else None
        for name in adapters.names():
            if (line := self._line(name)) is None:
                continue
            directive = await line.refresh(routing)
            self.store.protected[name] = line.protected
            if directive is None:
                continue
            directed = True
            if not line.concerns(directive, self.parents.get(name, 0)):
                line.pass_over(directive)
                continue
            await asyncio.to_thread(self._back_to, adapters, name, directive.version)
            line.abandon(directive, self.versions.get(name, 0))
            self.parents[name] = directive.version
        return directed

    def start(self, adapters: AdapterSet, name: str, origin: str | None) -> None:
        """Add `name` unless it is here, from `origin` (a user's adapter from its tenant's): the
        origin's weights as the trainer has them, or under promotion the origin's version that
        serves (what the gateway serves the user before their adapter has a version), not a
        candidate of it that may never pass the gate."""
        if name in adapters:
            return
        adapters.ensure(name, origin)
        if origin is not None and origin in self.lines:
            self._from_origin(adapters, name, origin)

    def may_train(self, samples: list[Any], config: FlywheelConfig) -> bool:
        """Whether the adapters of `samples` may take a step now: under promotion, none is too far
        ahead of its serving version (else the samples wait)."""
        lines = [(name, self.lines.get(name)) for name in {sample_adapter(s, config) for s in samples}]
        return all(line.may_step(self.versions.get(name, 0)) for name, line in lines if line is not None)

    def held_back(self) -> dict[str, int]:
        """Versions the guard held back, by adapter."""
        return dict(self.guard.held_back) if self.guard is not None else {}

    def staleness(self, adapter: str, oldest: int) -> int:
        """Updates between `adapter`'s current weights and its version `oldest`."""
        line = self.lines.get(adapter)
        current = self.versions.get(adapter, 0)
        return line.distance(current, oldest) if line is not None else current - oldest

    async def stepped(self, adapters: AdapterSet, samples: list[Sample], step: int, config: FlywheelConfig) -> None:
        """A step trained `samples`: each of their adapters' ledger line, where the last of its
        samples' conversations was asked (its guard asks there: `context_of`; a practice reply's,
        `details["practice_of"]`, is where the judge asked it, not where the adapter is used), and
        its publication when due."""
        by_adapter: dict[str, list[str]] = {}
        for sample in samples:
            name = sample_adapter(sample, config)
            by_adapter.setdefault(name, []).append(sample_digest(sample.id))
            if (trajectory := sample.trajectory) is not None and trajectory.turns and "practice_of" not in sample.details:
                self.contexts[name] = (trajectory.tenant, trajectory.user_id, context_of(trajectory.turns[-1]))
        if self.ledger is not None:
            for name, ids in by_adapter.items():
                self.ledger.trained(step, self.versions[name], ids, adapter=name)
        await self.publish_due(adapters, list(by_adapter), step)

    def trained(self, adapters: list[str]) -> None:
        """Each of `adapters` took a step: its weights are its next version."""
        for name in adapters:
            self.versions[name] = self.versions.get(name, 0) + 1

    async def publish_due(self, adapters: AdapterSet, names: list[str], step: int) -> list[str]:
        """Publish those of `names` that took `train.weight_update_interval` steps since their
        last publication, unless the guard holds one back; the ones published."""
        published = []
        for name in (name for name in names if adapters.steps[name] % self.interval == 0):
            if not await self._guarded(name):
                await asyncio.to_thread(self.hold_back, adapters, name)
                continue
            await self.publish(adapters, name, step)
            published.append(name)
        return published

    async def _guarded(self, name: str) -> bool:
        """Whether `name`'s current weights pass the guard (there is none: they do)."""
        if self.guard is None:
            return True
        context = self.contexts[name][2] if name in self.contexts else Context()
        return await asyncio.to_thread(self.guard.allows, name, self.origin_of(name), context)

    def hold_back(self, adapters: AdapterSet, name: str) -> None:
        """`name` back to its last published version (before any: its origin's weights, or the
        base), which its version becomes again; on a registry line (under promotion) its number
        stays, and the held-back one is skipped: a line's numbers only grow."""
        back = self._back_to(adapters, name, self.parents.get(name))
        if (line := self.lines.get(name)) is not None:
            line.skip(self.versions.get(name, 0))
        else:
            self.versions[name] = back

    async def roll_back(self, adapters: AdapterSet, name: str, version: int, step: int) -> int:
        """An end user's adapter `name` back to its published `version` (0: its start), with fresh
        moments, published and announced as a version above every one it had (its parent `version`):
        that one (flywheel/versions/adapter_rollback.py)."""
        newest = max(self.store.latest(name) or 0, self.versions.get(name, 0))
        await asyncio.to_thread(self._back_to, adapters, name, version)
        self.versions[name], self.parents[name] = newest + 1, version
        await self.publish(adapters, name, step)
        adapters.trim()  # brought into memory to be taken back: memory stays bounded
        return newest + 1

    def _back_to(self, adapters: AdapterSet, name: str, version: int | None) -> int:
        """`name`'s weights those of its published `version` (None, 0, or one no longer stored: its
        origin's, or the base), with fresh optimizer moments; the version they are."""
        if version and version in self.store.versions(name):
            adapters.restart(name, load_file(self.store.path(name, version) / WEIGHTS_FILE))
        else:
            self._from_origin(adapters, name, self.origin_of(name))
            version = 0
        if self.ledger is not None:
            self.ledger.back_to(version, adapter=name)
        return version

    def _from_origin(self, adapters: AdapterSet, name: str, origin: str | None) -> None:
        """`name` back to its start, fresh moments: its `origin`'s weights (under promotion the
        origin's version that serves, as `start`), else the base."""
        line = self.lines.get(origin) if origin is not None else None
        if origin is None or line is None or line.serving is None:
            adapters.restart(name, origin=origin)
            return
        stored = line.serving and line.serving in self.store.versions(origin)
        adapters.restart(name, load_file(self.store.path(origin, line.serving) / WEIGHTS_FILE) if stored else None)

    async def publish(self, adapters: AdapterSet, name: str, step: int) -> None:
        """Write `name`'s current version to the store (unless it is there) and announce it (again,
        after a restart: then with no parent)."""
        version = self.versions.get(name, 0)
        if version not in self.store.versions(name):
            await asyncio.to_thread(self.store.publish, name, version, adapters.config(name), adapters.weights(name))
        parent = self.parents.get(name, 0)
        update = WeightUpdate(id=f"adapter-{name}-v{version}-s{step}", adapter=name, version=version,
                              path=str(self.store.path(name, version)), step=step, parent=parent if parent < version else None)
        await self.bus.publish(WEIGHTS_SUBJECT, update)
        if (line := self.lines.get(name)) is not None:
            line.announced(version, parent)
        self.parents[name] = version
        log.info("published adapter %s v%d", name, version)

    async def restored(self, adapters: AdapterSet, step: int, config: FlywheelConfig) -> None:
        """After a restart: every adapter published before is the trainer's again (one a dead
        process made after the checkpoint starts over from its origin, as its weights do); an
        adapter whose store holds versions up to or past its restored one gets a version above
        them (when past), published and announced, so serving has it. Weights not published
        before (trained after the last publication) pass the guard first; failing it, the adapter
        goes back to its newest published version, announced again."""
        for name in self.store.names():
            adapters.ensure(name, origin(name, config))
        await self.follow_registry(adapters)  # what serves is protected before anything is published
        for name in adapters.names():
            newest = self.store.latest(name)
            if newest is None:
                continue
            if newest > self.versions.get(name, 0):
                log.info("adapter %s: versions up to %d were published after this state: it becomes %d", name, newest, newest + 1)
                self.versions[name] = newest + 1
            if self.versions[name] not in self.store.versions(name) and not await self._guarded(name):
                await asyncio.to_thread(self._back_to, adapters, name, newest)
                self.versions[name] = self.parents[name] = newest
            await self.publish(adapters, name, step)
            adapters.trim()  # each one read to be published: memory stays bounded

    def drop(self, name: str) -> None:
        """Forget `name` (a forgotten user's adapter): its versions, and its directory in the store
        (again: a step under way when it was forgotten may have published it since)."""
        self.versions.pop(name, None)
        self.parents.pop(name, None)
        self.contexts.pop(name, None)
        if self.guard is not None:
            self.guard.held_back.pop(name, None)
        self.lines.pop(name, None)
        self.store.protected.pop(name, None)
        self.store.delete(name)

    def forget(self, tenant: str, user: str | None) -> None:
        """Drop the system messages a forgotten tenant's (user None) or user's conversations gave
        (a tenant's adapter keeps its own, from its other users), and all the guard measured in
        any context (keyed by their words; what is needed again is measured again)."""
        self.contexts = {name: held for name, held in self.contexts.items()
                         if not forgets((tenant, user), held[:2])}
        if self.guard is not None:
            self.guard.forget_contexts()

    def state(self) -> dict[str, Any]:
        return {"versions": dict(self.versions), "parents": dict(self.parents),
                "lines": {name: line.state() for name, line in self.lines.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.versions = dict(state.get("versions", {}))
        self.parents = dict(state.get("parents", {}))
        for name, line_state in state.get("lines", {}).items():
            if (line := self._line(name)) is not None:
                line.restore(line_state)
