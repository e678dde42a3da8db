"""What the adapter tests share: a configuration of small adapters on the tiny model, samples that
an adapter sampled, a step's batch of groups, a trainer, and its weights and moments compared."""

from pathlib import Path

import torch

from flywheel.bus import Sample
from flywheel.models import load_model
from flywheel.train.advantages import RunningBaseline
from flywheel.train.grouping import Group, Member
from flywheel.train.step_batch import StepBatch
from flywheel.train.trainer import Trainer

from factories import sample_of

LORA = ["adapters.kind=lora", "adapters.rank=4", "adapters.alpha=8", "actor.optimizer.lr=0.01",
        "adapters.guard_drop=null"]  # the guard is test_adapter_guard.py's: tiny at this rate can pass its default bound


def of_adapter(turn, reward: float, adapter: str, version: int | None = 0) -> Sample:
    """The sample of a one-turn trajectory that `adapter` sampled (its tokens its `version`)."""
    sample = sample_of(turn, reward, version)
    sample.trajectory.adapter = adapter
    return sample


def step_of_groups(groups: dict[str, list[Sample]], config) -> StepBatch:
    """One step's batch of task groups (key: its samples)."""
    return StepBatch([Group(key, len(samples), 0.0, 0.0, {s.id: Member(s, []) for s in samples})
                      for key, samples in groups.items()], config, RunningBaseline(), pad_id=0)


def lora_trainer(config, seed: int = 0, adapter_dir: Path | None = None) -> Trainer:
    torch.manual_seed(seed)
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train, config.adapters)
    if adapter_dir is not None:
        trainer.adapters.keep_on_disk(adapter_dir)
    return trainer


def take_step(trainer: Trainer, batch: StepBatch, versions: dict[str, int] | None = None) -> dict:
    for name, start in batch.adapters.items():
        trainer.adapters.ensure(name, start)
    return trainer.step(batch.minibatches, version=versions or {})


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def optimizer_state(trainer: Trainer, name: str) -> list[dict[str, torch.Tensor]]:
    optimizer = trainer.adapters.optimizers[name]
    return [optimizer.state[p] for p in trainer.adapters.params[name]]


def one_adapters_step(turns, i: int, name: str, config) -> StepBatch:
    return step_of_groups({name: [of_adapter(turns[2 * i], 1.0, name), of_adapter(turns[2 * i + 1], 0.0, name)]}, config)
