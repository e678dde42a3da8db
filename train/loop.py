"""The train loop: scored samples in, new policy versions out.

Consumes SAMPLES durably. Samples whose oldest sampled token is more than
`rollout.max_head_offpolicyness` versions behind the trainer are dropped and counted (live
traffic cannot be refused at the door, so staleness is enforced here too). Every
`train.batch_size` fresh samples make one optimizer step; the samples are acknowledged after
it. Every `train.weight_update_interval` steps the weights go to the versioned store and a
`WeightUpdate` is announced on the bus. A version is the count of optimizer steps.
One JSON line per step goes to `run_dir/metrics.jsonl`.

Checkpoints (`train/checkpoint.py`) are saved every `train.checkpoint_interval` steps and when
the loop stops. With `train.resume` the loop continues from the newest one: weights, optimizer,
schedule, step, counters, baseline and RNG. Weight versions newer than that checkpoint are
removed from the store (they will be trained again) and the checkpoint's version is announced
anew, so serving follows. Without `train.resume`, a run directory that already has published
weights continues from the newest of them (weights only), as a redeployed live system does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, Bus, Delivery, Sample, WeightUpdate
from bus.process import repeat
from config import ConfigError, FlywheelConfig
from models import WeightStore, load_model, load_weights
from train.advantages import RunningBaseline, group_advantages, token_advantages
from train.batch import Row, micro_batches
from train.checkpoint import Checkpoints
from train.trainer import Trainer

log = logging.getLogger(__name__)


class TrainLoop:
    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "train"):
        self.config = config
        self.bus_url = bus_url
        self.durable = durable
        self.run_dir = Path(config.run_dir)
        self.baseline = RunningBaseline()
        self.buffer: list[Delivery] = []
        self.counts = {"samples": 0, "stale_dropped": 0, "unresolved": 0}
        self.staleness_seen: Counter[int] = Counter()
        """How many trained samples had each staleness (versions behind the trainer), all run."""
        self._checkpointed_at = 0
        self.last_metrics: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._inflight: asyncio.Task | None = None
        self._started = time.monotonic()

    @property
    def version(self) -> int:
        return self.trainer.step_count

    async def start(self) -> None:
        torch.manual_seed(self.config.seed)
        torch.set_num_threads(self.config.train.torch_threads)
        model, self.tokenizer = await asyncio.to_thread(load_model, self.config.model)
        self.store = WeightStore(self.run_dir / "weights", keep=self.config.train.keep_versions)
        self.checkpoints = Checkpoints(self.run_dir / "checkpoints", keep=self.config.train.keep_checkpoints)
        self.trainer = Trainer(model, self.config.actor, self.config.train)
        self.bus = await Bus.connect(self.bus_url, name="train")
        if self.config.train.resume:
            await self._resume()
        elif (latest := self.store.latest()) is not None:  # continue from the newest published policy
            load_weights(self.trainer.model, self.store.path(latest))
            self.trainer.step_count = latest
        self._checkpointed_at = self.version
        self.consumer = self.bus.consumer(SAMPLE_SUBJECT, self.durable)
        self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        self._task = asyncio.create_task(repeat(self._step, "train"), name="train")

    async def _resume(self) -> None:
        path = self.checkpoints.latest()
        if path is None:
            raise ConfigError(f"train.resume: no checkpoint in {self.checkpoints.directory}")
        state = await asyncio.to_thread(self.checkpoints.load, path, self.trainer.model)
        self.trainer.restore(state["trainer"])
        loop = state["loop"]
        self.counts, self.baseline.value = {**self.counts, **loop["counts"]}, loop["baseline"]
        self.staleness_seen = Counter(loop["staleness_seen"])
        discarded = self.store.discard_newer(self.version)
        if self.version not in self.store.versions():
            await asyncio.to_thread(self.store.publish, self.trainer.model, self.version)
        await self._announce(f"weights-v{self.version}-resumed-{uuid.uuid4().hex[:8]}")
        log.info("resumed from %s at step %d (discarded newer versions %s)", path, self.version, discarded)

    def is_stale(self, sample: Sample) -> bool:
        oldest = sample.trajectory.oldest_version
        return oldest is not None and self.version - oldest > self.config.rollout.max_head_offpolicyness

    async def _fetch(self, batch_size: int) -> list[Delivery]:
        """Up to `batch_size` samples, each with its trajectory attached. A sample whose
        trajectory the bus no longer holds is counted (`unresolved`) and terminated; one whose
        lookup failed (the bus away) is redelivered shortly."""
        deliveries = await self.consumer.fetch(batch=batch_size, timeout_s=0.5)
        found = await asyncio.gather(*(self.bus.resolve(d.record) for d in deliveries), return_exceptions=True)
        ready = []
        for delivery, outcome in zip(deliveries, found):
            if outcome is True:
                ready.append(delivery)
            elif outcome is False:
                self.counts["unresolved"] += 1
                await delivery.term()
            else:
                log.warning("could not look up the trajectory of %s (%s); retrying", delivery.record.id, outcome)
                await delivery.nak(delay_s=1.0)
        return ready

    async def _step(self) -> None:
        batch_size = self.config.train.batch_size
        self.buffer.extend(await self._fetch(batch_size))
        fresh = []
        for delivery in self.buffer:  # re-checked each step: a waiting sample ages too
            if self.is_stale(delivery.record):
                self.counts["stale_dropped"] += 1
                await delivery.ack()
            else:
                fresh.append(delivery)
        self.buffer = fresh
        max_steps = self.config.train.max_steps
        if len(self.buffer) < batch_size or (max_steps is not None and self.version >= max_steps):
            return
        taken, self.buffer = self.buffer[:batch_size], self.buffer[batch_size:]
        # A step runs to its end even if the loop is stopped meanwhile: `stop` waits for it.
        self._inflight = asyncio.create_task(self._optimize(taken))
        await asyncio.shield(self._inflight)

    async def _optimize(self, taken: list[Delivery]) -> None:
        """One optimizer step on `taken`, the publish and checkpoint it calls for, then the acks."""
        samples: list[Sample] = [d.record for d in taken]  # type: ignore[misc]
        metrics = await asyncio.to_thread(self._train, samples)
        self.counts["samples"] += len(samples)  # before the announcement and the checkpoint: they show this step
        self._record(metrics)
        if self.version % self.config.train.weight_update_interval == 0:
            await self._publish()
        interval = self.config.train.checkpoint_interval
        if interval and self.version % interval == 0:
            await self._checkpoint()
        for delivery in taken:
            await delivery.ack()

    def _train(self, samples: list[Sample]) -> dict[str, Any]:
        cfg = self.config.train
        rewards = [s.reward for s in samples]
        advantages = group_advantages(rewards, [s.trajectory.task_id for s in samples], self.baseline)
        rows = [
            Row(segment, values)
            for sample, advantage in zip(samples, advantages)
            for segment, values in zip(
                sample.trajectory.segments, token_advantages(sample, advantage, cfg.turn_reward_coef, cfg.turn_discount)
            )
        ]
        batches = micro_batches(rows, cfg.micro_batch_tokens, self.tokenizer.pad_token_id or 0, cfg.packing)
        staleness = [self.version - s.trajectory.oldest_version for s in samples if s.trajectory.oldest_version is not None]
        self.staleness_seen.update(staleness)
        metrics = self.trainer.step(batches)
        return {
            "reward_mean": fmean(rewards),
            "staleness_max": max(staleness, default=0),
            "staleness_mean": fmean(staleness) if staleness else 0.0,
            "staleness_hist": {str(k): v for k, v in sorted(Counter(staleness).items())},
            "n_samples": len(samples),
            "stale_dropped": self.counts["stale_dropped"],
            "unresolved": self.counts["unresolved"],
            **metrics,
        }

    async def _publish(self) -> None:
        version = self.version
        await asyncio.to_thread(self.store.publish, self.trainer.model, version)
        await self._announce(f"weights-v{version}")
        log.info("published weights v%d", version)

    async def _announce(self, announcement_id: str) -> None:
        update = WeightUpdate(id=announcement_id, version=self.version, path=str(self.store.path(self.version)), step=self.version)
        await self.bus.publish(WEIGHTS_SUBJECT, update)

    async def _checkpoint(self) -> None:
        state = {
            "trainer": self.trainer.state(),
            "loop": {"counts": dict(self.counts), "baseline": self.baseline.value, "staleness_seen": dict(self.staleness_seen)},
        }
        await asyncio.to_thread(self.checkpoints.save, self.version, self.trainer.model, state)
        self._checkpointed_at = self.version

    def _record(self, metrics: dict[str, Any]) -> None:
        line = {"step": self.version, "version": self.version, **metrics, "elapsed_s": time.monotonic() - self._started}
        self.last_metrics = line
        self.metrics_file.write(json.dumps(line) + "\n")
        self.metrics_file.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            if self._inflight is not None:
                with contextlib.suppress(Exception):
                    await self._inflight
            if self.version > self._checkpointed_at:
                await self._checkpoint()
        self.metrics_file.close()
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "buffered": len(self.buffer), **self.counts,
                "staleness_seen": dict(self.staleness_seen), "last": self.last_metrics}
