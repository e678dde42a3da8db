"""Shared weights rebuilt without forgotten samples: `flywheel forget --tenant T [--user U] --retrain`
(with `adapters.kind: lora`, the adapters: flywheel/train/adapter_retrain.py, which takes its steps
again with `take_again` on the samples `held_samples` finds).

`flywheel forget` removes a tenant's or a user's records; the weights trained on their samples
still hold what they learned. The ledger (`run_dir/trained.jsonl`) says which steps used them,
and the durable log still holds everyone else's samples, so the steps can be taken again
without them:

1. the start is the newest checkpoint from before the first step that used a forgotten sample
   (its weights, optimizer and schedule), else the base model with a fresh optimizer;
2. every step from there to the newest checkpoint is taken again, on the same groups of the same
   samples in the same order, less the forgotten ones and those the SAMPLES stream no longer
   holds (past its age: counted as `missing`), through the trainer's own objective;
3. the result is published as a new version, which reaches traffic the way any version does:
   through the promotion gate and canary when `promotion.mode` is on (the operator can still
   reject it with `flywheel versions`), at once when it is off;
4. the trainer's checkpoints from after the start are replaced by the rebuilt state, and the
   ledger says so (`resumed_at_step`), so a trainer that starts again continues from the rebuilt
   weights. The versions published before keep their weights in the store until pruned.

The trainer must be stopped, and the caller holds its lock (`run_dir/train.lock`) throughout:
the trainer's weights in memory would outlive the rewrite. Costs a training step per step replayed, on the trainer's device. The importance
ratios of a replayed step are taken against the weights being rebuilt, as the decoupled
objective does for any stale sample; the behaviour log-probs stay the engine's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.bus import Sample
from flywheel.bus.records import AuditEntry, sample_digest
from flywheel.bus.scan import stored_records
from flywheel.bus.streams import AUDIT_SUBJECT, SAMPLES
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.models import WeightStore, load_model
from flywheel.train.advantages import RunningBaseline
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.grouping import GroupBatcher
from flywheel.train.ledger import lineage
from flywheel.train.publisher import WeightPublisher
from flywheel.train.step_batch import StepBatch
from flywheel.train.trainer import Trainer


@dataclass
class Retrained:
    """What `retrain` did."""

    from_step: int
    """The step of the checkpoint it started from (0: the base model)."""
    steps: int
    """Steps taken again (a step left with no sample is skipped)."""
    samples: int
    left_out: int
    """Forgotten samples the original steps used."""
    missing: int
    """Samples of the replayed steps the SAMPLES stream no longer holds (past its age)."""
    version: int | None
    """The version published (None: no step to take again)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def retrain(config: FlywheelConfig, bus: Any, forgotten: set[str], target: str, actor: str = "cli") -> Retrained:
    """Rebuild the trainer's newest checkpoint without the samples whose digests are `forgotten`
    (see the module docstring); `target` names whom they were forgotten for, on the audit log.
    The caller holds the run directory's `RunLock` (no trainer runs meanwhile)."""
    if config.adapters.kind == "lora":  # the adapters': flywheel/train/adapter_retrain.py
        raise ConfigError("adapters.kind: lora: the adapters are retrained by adapter_retrain.retrain_adapters")
    run_dir = Path(config.run_dir)
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=config.train.keep_checkpoints)
    ledger_path = run_dir / "trained.jsonl"
    steps = lineage(ledger_path) if ledger_path.exists() else []
    newest = checkpoints.steps()[-1] if checkpoints.steps() else 0
    affected = [s["step"] for s in steps if s["step"] <= newest and forgotten.intersection(s["samples"])]
    if not affected:
        return Retrained(0, 0, 0, 0, 0, None)  # no checkpointed weights learned from them
    start = max((s for s in checkpoints.steps() if s < affected[0]), default=0)
    replay = [s for s in steps if start < s["step"] <= newest]
    held = await held_samples(bus, {d for s in replay for d in s["samples"]} - forgotten)

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.train.torch_threads)  # the trainer's: its numbers, not a near copy
    model, tokenizer = await asyncio.to_thread(load_model, config.model)
    trainer = Trainer(model, config.actor, config.train)
    baseline = RunningBaseline()
    newest_state = torch.load(checkpoints.path(newest) / "state.pt", weights_only=False)
    parent = None
    if start:
        state = await asyncio.to_thread(checkpoints.load, checkpoints.path(start), trainer.model)
        trainer.restore(state["trainer"])
        baseline.value = state["loop"]["baseline"]
        parent = state["loop"].get("version")

    report = Retrained(start, 0, 0, 0, 0, None)
    taken: list[list[str]] = []
    for step in replay:
        samples = [held[d] for d in step["samples"] if d in held]
        report.left_out += sum(d in forgotten for d in step["samples"])
        report.missing += sum(d not in forgotten and d not in held for d in step["samples"])
        if not samples:
            continue
        await asyncio.to_thread(take_again, trainer, samples, config, baseline, tokenizer.pad_token_id or 0)
        taken.append([sample_digest(s.id) for s in samples])
        report.steps += 1
        report.samples += len(samples)

    publisher = WeightPublisher(WeightStore(run_dir / "weights", keep=config.train.keep_versions), bus)
    report.version = (await publisher.newest() or 0) + 1
    await _replace_checkpoints(checkpoints, start, trainer, baseline, newest_state, report.version, forgotten)
    with ledger_path.open("a") as ledger:
        ledger.write(json.dumps({"resumed_at_step": start}) + "\n")
        for number, digests in enumerate(taken, start + 1):
            ledger.write(json.dumps({"step": number, "version": report.version, "samples": digests}) + "\n")
    await publisher.publish(trainer.model, report.version, trainer.step_count, {
        "parent": parent, "trained_on": {"samples": report.samples, "steps": [start + 1, trainer.step_count],
                                         "sample_digests": [d for digests in taken for d in digests][-256:]},
        "config": {"retrained_without": target, "from_step": start}})
    await bus.publish(AUDIT_SUBJECT, AuditEntry(id=uuid.uuid4().hex, actor=actor, action="retrain",
                                                target=f"v{report.version}", details={"without": target, **report.as_dict()}))
    return report


def take_again(trainer: Trainer, samples: list[Sample], config: FlywheelConfig, baseline: RunningBaseline,
               pad_id: int) -> None:
    """One step of `trainer` on `samples`, in their groups, as the train loop takes a step."""
    batcher = GroupBatcher(batch_size=len(samples), group_timeout_s=0.0)
    for sample in samples:
        batcher.add(sample, None)
    groups = batcher.take()
    assert groups is not None
    trainer.step(StepBatch(groups, config, baseline, pad_id).minibatches)


async def held_samples(bus: Any, wanted: set[str]) -> dict[str, Sample]:
    """The samples the SAMPLES stream holds among `wanted` (digests), with their trajectories."""
    found: dict[str, Sample] = {}
    async for stored in stored_records(bus, SAMPLES.name):
        digest = sample_digest(stored.record.id)
        if digest in wanted and stored.record.consent and await bus.resolve(stored.record):
            found[digest] = stored.record
    return found


async def _replace_checkpoints(checkpoints: Checkpoints, start: int, trainer: Trainer, baseline: RunningBaseline,
                               newest: dict[str, Any], version: int, forgotten: set[str]) -> None:
    """Save the rebuilt state as the newest checkpoint and remove those after `start`."""
    loop = {**newest["loop"], "baseline": baseline.value, "version": version,
            "trained": [d for d in newest["loop"].get("trained", []) if d not in forgotten]}
    unpruned = Checkpoints(checkpoints.directory, keep=len(checkpoints.steps()) + 1)  # its step may be the lowest
    kept = await asyncio.to_thread(unpruned.save, trainer.step_count, trainer.model, {"trainer": trainer.state(), "loop": loop})
    for step in checkpoints.steps():
        if step > start and checkpoints.path(step) != kept:
            shutil.rmtree(checkpoints.path(step), ignore_errors=True)
