"""Full training checkpoints, for `--resume`: everything a run needs to go on as if never stopped.

A checkpoint is a directory `run_dir/checkpoints/step-NNNNNNNN/` holding the model
(safetensors + config, loadable by itself) and `state.pt`: optimizer and learning-rate schedule
state, the trainer's step, the loop's counters (samples, stale drops, the staleness histogram,
the running reward baseline) and the torch and Python RNG states. The directory appears
atomically (written aside, then renamed), so a crash mid-save leaves the previous checkpoint as
the newest. The newest `train.keep_checkpoints` are kept.

With `adapters.kind: lora` the base never changes and is not saved: `state.pt` holds every
adapter's weights, optimizer and schedule instead (`AdapterSet.state`), and the loop's version
of each adapter. An adapter the trainer keeps on disk (beyond `adapters.train_resident`) is a
`CheckpointFile` in the state: its file is hard-linked into the checkpoint's `files/`, so the
checkpoint holds it as it was, without reading it into memory.

The rollout driver keeps its own data position and RNG next to the run (`flywheel/rollout/driver.py`):
a checkpoint holds what the trainer owns.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.models import atomic_directory, load_weights

PREFIX = "step-"
FILES = "files"


@dataclass(frozen=True)
class CheckpointFile:
    """A file the state names instead of holding: saved into the checkpoint (`Checkpoints.save`
    links it into its `files/`), and named there when the checkpoint is loaded."""

    path: Path


class Checkpoints:
    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory)
        self.keep = keep

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name.removeprefix(PREFIX)) for p in self.directory.glob(f"{PREFIX}*") if p.is_dir())

    def path(self, step: int) -> Path:
        return self.directory / f"{PREFIX}{step:08d}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, step: int, model: torch.nn.Module | None, state: dict[str, Any]) -> Path:
        """Write the checkpoint of `step` (replacing one of the same step) and prune old ones;
        the model's weights unless `model` is None (the frozen base under adapters)."""
        dest = self.path(step)
        if dest.exists():
            shutil.rmtree(dest)
        state = {**state, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        with atomic_directory(dest) as tmp:
            if model is not None:
                model.save_pretrained(tmp)
            torch.save(_files(state, lambda f: _link(f.path, tmp / FILES)), tmp / "state.pt")
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return dest

    def load(self, path: Path, model: torch.nn.Module | None) -> dict[str, Any]:
        """Load the weights into `model` in place (unless None), restore the RNGs, return the rest
        of the state."""
        if model is not None:
            load_weights(model, path)
        state = _files(torch.load(path / "state.pt", weights_only=False), lambda f: CheckpointFile(path / f.path))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return state


def _files(value: Any, change) -> Any:
    """`value` with each `CheckpointFile` in its dicts and lists replaced by `change(file)`."""
    if isinstance(value, CheckpointFile):
        return change(value)
    if isinstance(value, dict):
        return {k: _files(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_files(v, change) for v in value]
    return value


def _link(source: Path, directory: Path) -> CheckpointFile:
    """`source` into `directory`; its path there, relative to the checkpoint."""
    directory.mkdir(exist_ok=True)
    link_or_copy(source, directory / source.name)
    return CheckpointFile(Path(FILES) / source.name)


def link_or_copy(source: Path, target: Path) -> None:
    """`target` a hard link to `source` (a copy across file systems): for files never changed."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
