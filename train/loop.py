"""The train loop: scored samples in, new policy versions out.

Consumes SAMPLES durably. Samples whose oldest sampled token is more than
`rollout.max_head_offpolicyness` versions behind the trainer are dropped and counted (live
traffic cannot be refused at the door, so staleness is enforced here too). Every
`train.batch_size` fresh samples make one optimizer step; the samples are acknowledged after
it. Every `train.weight_update_interval` steps the weights go to the versioned store and a
`WeightUpdate` is announced on the bus. A version is the count of optimizer steps.
One JSON line per step goes to `run_dir/metrics.jsonl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, Bus, Delivery, Sample, WeightUpdate
from bus.process import repeat
from config import FlywheelConfig
from models import WeightStore, load_model, load_weights
from train.advantages import RunningBaseline, group_advantages
from train.batch import build_batch
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
        self.counts = {"samples": 0, "stale_dropped": 0}
        self.last_metrics: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._started = time.monotonic()

    @property
    def version(self) -> int:
        return self.trainer.step_count

    async def start(self) -> None:
        torch.manual_seed(self.config.seed)
        torch.set_num_threads(self.config.train.torch_threads)
        model, self.tokenizer = await asyncio.to_thread(load_model, self.config.model)
        self.store = WeightStore(self.run_dir / "weights", keep=self.config.train.keep_versions)
        self.trainer = Trainer(model, self.config.actor)
        latest = self.store.latest()
        if latest is not None:  # continue from the newest published policy
            load_weights(model, self.store.path(latest))
            self.trainer.step_count = latest
        self.bus = await Bus.connect(self.bus_url, name="train")
        self.consumer = self.bus.consumer(SAMPLE_SUBJECT, self.durable)
        self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        self._task = asyncio.create_task(repeat(self._step, "train"), name="train")

    def is_stale(self, sample: Sample) -> bool:
        oldest = sample.trajectory.oldest_version
        return oldest is not None and self.version - oldest > self.config.rollout.max_head_offpolicyness

    async def _step(self) -> None:
        batch_size = self.config.train.batch_size
        self.buffer.extend(await self.consumer.fetch(batch=batch_size, timeout_s=0.5))
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
        samples: list[Sample] = [d.record for d in taken]  # type: ignore[misc]
        metrics = await asyncio.to_thread(self._train, samples)
        if self.version % self.config.train.weight_update_interval == 0:
            await self._publish()
        for delivery in taken:
            await delivery.ack()
        self.counts["samples"] += len(samples)
        self._record(metrics)

    def _train(self, samples: list[Sample]) -> dict[str, Any]:
        rewards = [s.reward for s in samples]
        advantages = group_advantages(rewards, [s.trajectory.task_id for s in samples], self.baseline)
        batch = build_batch(samples, advantages, self.tokenizer.pad_token_id or 0)
        staleness = [self.version - s.trajectory.oldest_version for s in samples if s.trajectory.oldest_version is not None]
        metrics = self.trainer.step(batch)
        return {
            "reward_mean": fmean(rewards),
            "staleness_max": max(staleness, default=0),
            "staleness_mean": fmean(staleness) if staleness else 0.0,
            "n_samples": len(samples),
            **metrics,
        }

    async def _publish(self) -> None:
        version = self.version
        path = await asyncio.to_thread(self.store.publish, self.trainer.model, version)
        await self.bus.publish(
            WEIGHTS_SUBJECT, WeightUpdate(id=f"weights-v{version}", version=version, path=str(path), step=version)
        )
        log.info("published weights v%d", version)

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
        self.metrics_file.close()
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        return {"version": self.version, "buffered": len(self.buffer), **self.counts, "last": self.last_metrics}
