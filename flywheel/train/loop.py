"""The train loop: scored samples in, new policy versions out, each sample trained once.

Consumes SAMPLES durably and hands the pieces to their owners (one JSON line per step goes to
`run_dir/metrics.jsonl`):

- each sample gets its trajectory (`Bus.resolve`; one the stream no longer holds is counted
  `unresolved`) and is dropped if it was trained already (`duplicates_dropped`: the bus
  delivers at least once; the samples trained are remembered by their digests, and checkpointed);
- `GroupBatcher` (flywheel/train/grouping.py) holds samples until their task group is whole and drops
  groups older than η = `rollout.max_head_offpolicyness` versions (`stale_dropped`);
- `flywheel/train/step_batch.py` turns a step's groups into advantages, minibatches and micro-batches;
  `Trainer` (flywheel/train/trainer.py) takes the step;
- `WeightPublisher` (flywheel/train/publisher.py) publishes and announces a new version every
  `train.weight_update_interval` steps; `Checkpoints` saves every `train.checkpoint_interval`.

Exactly once. A sample is acknowledged only when a checkpoint that holds it (its effect on the
weights and its id) is saved; until then it is kept from redelivery with progress acknowledgements.
A trainer that dies restarts from its newest checkpoint (always, whether or not `train.resume` is
set), the bus sends it again what it trained since, and it trains that once more from the same
state; redeliveries of what the checkpoint holds are dropped by id. The steps of the abandoned
weights are marked in `run_dir/trained.jsonl` (flywheel/train/ledger.py). Versions only grow:
restarting behind published versions gives the weights a new one.

Under promotion (`promotion.mode` not off) the loop also follows the version registry before each
step (flywheel/train/under_promotion.py): it continues from the version a directive names, measures
staleness in updates that were not abandoned, keeps pace with the serving version, and keeps the
served versions in the weight store.

With `adapters.kind: lora` the base stays frozen and each sample trains its adapter
(flywheel/train/adapters.py): versions, staleness and publishing are per adapter (`AdapterVersions`,
flywheel/train/adapter_versions.py), each adapter published alone to `run_dir/adapters/`
(flywheel/models/adapter_store.py); between two steps it forgets adapters and takes users' back as
operators ask (flywheel/train/audit_requests.py). Promotion holds per adapter too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from flywheel.bus import SAMPLE_SUBJECT, Delivery, Sample
from flywheel.bus.consumer_loop import ConsumerLoop
from flywheel.bus.dedup import RecentIds
from flywheel.bus.records import sample_digest
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.models import WeightStore, load_model, load_weights
from flywheel.models.adapter_names import sample_adapter
from flywheel.runtime import repeat
from flywheel.train.advantages import RunningBaseline
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.audit_requests import AuditRequests
from flywheel.train.grouping import Group, GroupBatcher
from flywheel.train.ledger import Ledger
from flywheel.train.publisher import Lineage, WeightPublisher
from flywheel.train.run_lock import RunLock, TrainerRunning
from flywheel.train.step_batch import StepBatch
from flywheel.train.trainer import Trainer
from flywheel.train.under_promotion import UnderPromotion
from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)


class TrainLoop(ConsumerLoop):
    name = "train"
    subjects = SAMPLE_SUBJECT

    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "train"):
        super().__init__(config, bus_url, durable)
        self.run_dir = Path(config.run_dir)
        self.baseline = RunningBaseline()
        self.counts = {"samples": 0, "stale_dropped": 0, "unresolved": 0, "duplicates_dropped": 0, "abandoned_dropped": 0,
                       "refused_no_consent": 0}
        self.excluded: Counter[str] = Counter()
        """Sampled tokens left out of the loss, by reason (flywheel/train/trainable_tokens.py), all run."""
        self.staleness_seen: Counter[int] = Counter()
        """How many trained samples had each staleness (versions behind the trainer), all run."""
        self.version = 0
        self.lora = config.adapters.kind == "lora"
        self.batcher = GroupBatcher(config.train.batch_size, config.train.group_timeout_s)
        self.trained = RecentIds(config.train.remember_samples)
        self.unacknowledged: list[Delivery] = []
        """Deliveries of trained samples, acknowledged at the next checkpoint."""
        self._training: list[Group] = []
        """The groups of the step under way (held too: a step can outlast the ack wait)."""
        self._arriving: list[Delivery] = []
        """Samples fetched whose trajectories are being looked up (held too: on a loaded bus the
        lookups can outlast the ack wait)."""
        self._checkpointed_at = -1
        self.last_metrics: dict[str, Any] = {}
        self._inflight: asyncio.Task | None = None
        self._started = time.monotonic()

    @property
    def buffer(self) -> int:
        """Samples waiting for their group or a batch."""
        return len(self.batcher)

    async def start(self) -> None:
        torch.manual_seed(self.config.seed)
        torch.set_num_threads(self.config.train.torch_threads)
        model, self.tokenizer = await asyncio.to_thread(load_model, self.config.model)
        self.checkpoints = Checkpoints(self.run_dir / "checkpoints", keep=self.config.train.keep_checkpoints)
        self.trainer = Trainer(model, self.config.actor, self.config.train, self.config.adapters)
        await super().start()
        if self.lora:  # forgettings and adapter rollbacks (flywheel/train/audit_requests.py)
            self._tasks.append(asyncio.create_task(repeat(self.audit_requests.follow, "train.audit"), name="train.audit"))

    async def prepare(self) -> None:
        self.lock = RunLock(self.run_dir)
        try:
            self.lock.acquire()
        except TrainerRunning as exc:
            raise ConfigError(f"run_dir: {exc}: one trainer per run directory") from None
        with contextlib.ExitStack() as refused:  # refused after all (train.resume without a checkpoint): all let go
            refused.callback(self.lock.release)
            registry = await Registry.open(self.bus) if self.config.promotion.enabled else None
            self.ledger = Ledger(self.run_dir / "trained.jsonl")
            refused.callback(self.ledger.close)
            if self.lora:
                from flywheel.train.adapter_versions import AdapterVersions  # PEFT loads only where adapters train

                self.adapter_versions = AdapterVersions.of(self.config, self.run_dir, self.bus, self.trainer.adapters,
                                                           self.tokenizer, registry, self.ledger)
                self.audit_requests = AuditRequests(self.bus, self.checkpoints)
                self.trainer.adapters.keep_on_disk(self.run_dir / "trainer_adapters")  # under the lock: a live trainer's are not ours
            else:
                self.store = WeightStore(self.run_dir / "weights", keep=self.config.train.keep_versions)
                self.publisher = WeightPublisher(self.store, self.bus)
            self.promotion = (UnderPromotion(registry, self.config.rollout.max_head_offpolicyness)
                              if registry is not None and not self.lora else None)
            await self._restore()
            self._checkpointed_at = self.trainer.step_count
            self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
            refused.pop_all()  # prepared: `finish` lets go of them

    def held(self) -> list[Delivery]:
        return [*self._arriving, *self.batcher.deliveries(), *(d for g in self._training for d in g.deliveries), *self.unacknowledged]

    async def _restore(self) -> None:
        """Continue from the newest checkpoint, if any, at a version newer than any published before."""
        path = self.checkpoints.latest()
        if path is None and self.config.train.resume:
            raise ConfigError(f"train.resume: no checkpoint in {self.checkpoints.directory}")
        if path is not None:
            state = await asyncio.to_thread(self.checkpoints.load, path, None if self.lora else self.trainer.model)
            self.trainer.restore(state["trainer"])
            loop = state["loop"]
            self.counts = {**self.counts, **loop["counts"]}
            self.baseline.value = loop["baseline"]
            for name, value in loop.get("adapter_baselines", {}).items():
                self.baseline.of(name).value = value
            self.staleness_seen = Counter({int(k): v for k, v in loop["staleness_seen"].items()})
            self.excluded = Counter(loop.get("excluded", {}))
            self.batcher.counts.update(loop.get("batcher", {}))
            self.version = loop.get("version", self.trainer.step_count)
            self.trained.add(loop.get("trained", []))
            if self.lora:
                self.adapter_versions.restore(loop.get("adapters", {}))
            if self.promotion is not None:
                self.promotion.restore(loop.get("promotion", {}))
            log.info("resumed from %s at step %d, version %d", path, self.trainer.step_count, self.version)
        self.ledger.resumed(self.trainer.step_count)  # 0 without a checkpoint: a dead process's steps lead nowhere
        if self.lora:
            await self.adapter_versions.restored(self.trainer.adapters, self.trainer.step_count, self.config)
            return
        newest = await self.publisher.newest()
        if newest is not None and newest > self.version:
            log.info("versions up to %d were published after this state: it becomes version %d", newest, newest + 1)
            self.version = newest + 1
        if newest is not None:
            await self.publisher.publish(self.trainer.model, self.version, self.trainer.step_count)
        settings = {"model": self.config.model, "train": self.config.train.model_dump(mode="json"),
                    "actor": self.config.actor.model_dump(mode="json")}
        self.lineage = Lineage(parent=self.version, config=settings)

    def staleness(self, version: int) -> int:
        """Updates between the trainer's weights and those of `version`."""
        return self.promotion.distance(self.version, version) if self.promotion else self.version - version

    def sample_staleness(self, sample: Sample, oldest: int) -> int:
        """Updates between the weights `sample` trains (its adapter's, with adapters) and `oldest`."""
        if self.lora:
            return self.adapter_versions.staleness(sample_adapter(sample, self.config), oldest)
        return self.staleness(oldest)

    def is_stale(self, sample: Sample) -> bool:
        oldest = sample.trajectory.oldest_version
        return oldest is not None and self.sample_staleness(sample, oldest) > self.config.rollout.max_head_offpolicyness

    def is_abandoned(self, sample: Sample) -> bool:
        """Whether tokens of the sample came from a version a directive abandoned (its adapter's line's, with adapters)."""
        line = self.adapter_versions.lines.get(sample_adapter(sample, self.config)) if self.lora else self.promotion
        if line is None or not line.abandoned:
            return False
        return any(line.is_abandoned(v) for seg in sample.trajectory.segments for v in set(seg.versions))

    async def _follow_registry(self) -> bool:
        """Carry out a new directive; whether the trainer may take a step now."""
        assert self.promotion is not None
        directive = await self.promotion.refresh(await self.promotion.registry.routing())
        self.store.protected = self.promotion.protected
        if directive is not None and not self.promotion.concerns(directive, self.lineage.parent):
            self.promotion.pass_over(directive)
            await self._checkpoint()
        elif directive is not None:
            await asyncio.to_thread(load_weights, self.trainer.model, directive.path or self.config.model)
            self.trainer.optimizer.state.clear()
            self.promotion.abandon(directive, self.version)
            self.ledger.back_to(directive.version)
            self.lineage.parent = directive.version
            await self._checkpoint()
        return self.promotion.may_step(self.version)

    async def _fetch(self, batch_size: int) -> list[Delivery]:
        """Up to `batch_size` samples, each with its trajectory attached. A sample without consent
        to train (its own or its trajectory's) is refused: counted (`refused_no_consent`) and
        terminated, never trained. A sample whose trajectory the bus no longer holds is counted
        (`unresolved`) and terminated; one whose lookup failed (the bus away) is redelivered shortly."""
        deliveries = []
        for delivery in await self.consumer.fetch(batch=batch_size, timeout_s=0.5):
            if delivery.record.consent:
                deliveries.append(delivery)
            else:
                await self._refuse(delivery)
        self._arriving = deliveries
        try:
            found = await asyncio.gather(*(self.bus.resolve(d.record) for d in deliveries), return_exceptions=True)
        finally:
            self._arriving = []
        ready = []
        for delivery, outcome in zip(deliveries, found):
            if outcome is True and not delivery.record.trajectory.consent:
                await self._refuse(delivery)
            elif outcome is True:
                ready.append(delivery)
            elif outcome is False:
                self.counts["unresolved"] += 1
                await delivery.term()
            else:
                log.warning("could not look up the trajectory of %s (%s); retrying", delivery.record.id, outcome)
                await delivery.nak(delay_s=1.0)
        return ready

    async def _refuse(self, delivery: Delivery) -> None:
        self.counts["refused_no_consent"] += 1
        log.warning("refused sample %s of tenant %s: no consent to train", delivery.record.id, delivery.record.tenant)
        await delivery.term()

    async def _admit(self, delivery: Delivery) -> None:
        """Into the batcher, unless the sample was trained or is held already (a redelivery:
        its delivery is kept with the first, so the message is acknowledged only when that is)."""
        sample: Sample = delivery.record  # type: ignore[assignment]
        held = self.batcher.holds(sample.id)
        if sample_digest(sample.id) in self.trained or held is not None:
            self.counts["duplicates_dropped"] += 1
            if held is not None:
                held.deliveries.append(delivery)
            elif any(d.record.id == sample.id for d in self.unacknowledged):
                self.unacknowledged.append(delivery)
            else:
                await delivery.ack()
            return
        self.batcher.add(sample, delivery)

    async def step(self) -> None:
        for delivery in await self._fetch(self.config.train.batch_size):
            await self._admit(delivery)
        if self.lora and await self.audit_requests.apply(self):
            await self._checkpoint()  # at once: no checkpoint holds a forgotten adapter, none is carried out again
        if self.promotion is not None and not await self._follow_registry():
            return  # too far ahead of the serving version: the samples wait
        if self.lora and await self.adapter_versions.follow_registry(self.trainer.adapters):
            await self._checkpoint()  # a directive carried out or passed over: not again after a restart
        for reason, dropped in (("abandoned_dropped", self.is_abandoned), ("stale_dropped", self.is_stale)):
            for group in self.batcher.drop_stale(dropped):  # re-checked each step: a waiting sample ages too
                self.counts[reason] += len(group.members)
                for delivery in group.deliveries:
                    await delivery.ack()
        max_steps = self.config.train.max_steps
        if max_steps is not None and self.trainer.step_count >= max_steps:
            return
        groups = self.batcher.take(lambda g: not self.lora or self.adapter_versions.may_train(g.samples, self.config))
        if groups is None:
            return
        # A step runs to its end even if the loop is stopped meanwhile: `stop` waits for it.
        self._inflight = asyncio.create_task(self._optimize(groups))
        await asyncio.shield(self._inflight)

    async def _optimize(self, groups: list[Group]) -> None:
        """One training step on `groups`, then the publish and checkpoint it calls for."""
        self._training = groups
        metrics = await asyncio.to_thread(self._train, groups)
        ids = [sample_digest(s.id) for g in groups for s in g.samples]
        self.counts["samples"] += len(ids)  # before the announcement and the checkpoint: they show this step
        self.trained.add(ids)
        self.unacknowledged.extend(d for g in groups for d in g.deliveries)
        self._training = []
        self._record(metrics)
        if self.lora:  # each adapter's ledger line, and its publication when due
            await self.adapter_versions.stepped(self.trainer.adapters, [s for g in groups for s in g.samples],
                                                self.trainer.step_count, self.config)
        else:
            self.ledger.trained(self.trainer.step_count, self.version, ids)
            await self._publish(ids, metrics)
        interval = self.config.train.checkpoint_interval
        if interval and self.trainer.step_count % interval == 0:
            await self._checkpoint()

    async def _publish(self, ids: list[str], metrics: dict[str, Any]) -> None:
        """The step in the lineage; the weights published and announced when due."""
        self.lineage.trained(self.trainer.step_count, ids, metrics)
        if self.trainer.step_count % self.config.train.weight_update_interval == 0:
            lineage = self.lineage.announced(self.version)
            if self.promotion is not None:
                self.promotion.announced(self.version, lineage["parent"])
            await self.publisher.publish(self.trainer.model, self.version, self.trainer.step_count, lineage)
            log.info("published weights v%d", self.version)

    def _train(self, groups: list[Group]) -> dict[str, Any]:
        batch = StepBatch(groups, self.config, self.baseline, self.tokenizer.pad_token_id or 0)
        samples = [s for g in groups for s in g.samples]
        staleness = [self.sample_staleness(s, v) for s, v in zip(samples, batch.oldest_versions) if v is not None]
        self.staleness_seen.update(staleness)
        self.excluded.update(batch.excluded)
        if self.lora:
            for name, start in batch.adapters.items():
                self.adapter_versions.start(self.trainer.adapters, name, start)
            metrics = self.trainer.step(batch.minibatches, version=dict(self.adapter_versions.versions))
            self.adapter_versions.trained(list(batch.adapters))
        else:
            metrics = self.trainer.step(batch.minibatches, version=self.version)
        self.version += 1
        return {
            "reward_mean": batch.reward_mean,
            "advantage_abs_mean": batch.advantage_abs_mean,
            "staleness_max": max(staleness, default=0),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_hist": {str(k): v for k, v in sorted(Counter(staleness).items())},
            "n_samples": batch.n_samples,
            "n_groups": len(groups),
            "turns_mean": batch.turns_mean,
            "threads_mean": batch.threads_mean,
            "hinted_turn_share": batch.hinted_turns / batch.turns if batch.turns else 0.0,
            "attribution": batch.attribution,
            "excluded_tokens": dict(batch.excluded),
            **self.counts,
            **self.batcher.counts,
            **metrics,
        }

    async def _checkpoint(self) -> None:
        """Save everything, then acknowledge the samples it holds."""
        state = {
            "trainer": self.trainer.state(),
            "loop": {"counts": dict(self.counts), "baseline": self.baseline.value, "staleness_seen": dict(self.staleness_seen),
                     "adapter_baselines": {name: b.value for name, b in self.baseline.adapters.items()},
                     "excluded": dict(self.excluded), "batcher": dict(self.batcher.counts), "version": self.version,
                     "trained": self.trained.to_list(), "promotion": self.promotion.state() if self.promotion else {},
                     "adapters": self.adapter_versions.state() if self.lora else {}},
        }
        model = None if self.lora else self.trainer.model  # with adapters the base never changes
        await asyncio.to_thread(self.checkpoints.save, self.trainer.step_count, model, state)
        self._checkpointed_at = self.trainer.step_count
        acknowledged, self.unacknowledged = self.unacknowledged, []
        for delivery in acknowledged:
            with contextlib.suppress(Exception):  # a lost ack is a redelivery, dropped by id
                await delivery.ack()

    def _record(self, metrics: dict[str, Any]) -> None:
        line = {"step": self.trainer.step_count, "version": self.version, **metrics, "elapsed_s": time.monotonic() - self._started}
        self.last_metrics = line
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()

    async def finish(self) -> None:
        """Let a step under way end, checkpoint what was trained since the last one (acknowledging it)."""
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                await self._inflight
        if self.trainer.step_count > self._checkpointed_at or self.unacknowledged:
            await self._checkpoint()
        self.metrics_file.close()
        self.ledger.close()
        self.lock.release()

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "step": self.trainer.step_count, "buffered": self.buffer, **self.counts,
                "adapters": dict(self.adapter_versions.versions) if self.lora else {},
                "held_back": self.adapter_versions.held_back() if self.lora else {},
                **self.batcher.counts, "excluded_tokens": dict(self.excluded), "staleness_seen": dict(self.staleness_seen),
                "last": self.last_metrics}
