"""The trainer's LoRA adapters (`adapters.kind: lora`): many adapters on one frozen base, each
with its own AdamW and learning-rate schedule.

The base's weights never train. PEFT injects the LoRA layers into the trainer's model in place
(`adapters.rank`, `alpha`, `dropout`, `target_modules`: all linear layers but the output head by
default), so the trainer's forward passes are the model's own with the active adapter added;
`activate` makes one adapter active (and the only one with gradients), `disabled` gives the bare
base (the frozen KL reference). Each adapter's optimizer holds only that adapter's parameters,
so no adapter's update ever sees another's gradients.

Which adapter a sample trains, and which one a new adapter starts from, is
`flywheel.models.adapter_names.sample_adapter` and `origin`. A new adapter starts from PEFT's
initialisation (B = 0: exactly the base), or from a copy of its origin's weights when the
trainer has that adapter.

Inside PEFT an adapter is a slot key (`slot<n>`): PEFT keeps adapters in module dictionaries,
whose keys cannot hold the `.` that user adapters' names have. Keys never leave this file: the
published directories and the checkpoint name adapters by their names.

**Memory.** Given a directory (`keep_on_disk`: the train loop's `run_dir/trainer_adapters`, once
it holds the run directory's lock), at most `adapters.train_resident` adapters stay in the model
after a step (`trim`); the least recently used others are written there whole (weights,
optimizer, schedule) and leave the model, and come back when next used, exactly as they left. A
checkpoint names their files instead of holding them (`CheckpointFile`). The directory is emptied
when it is given (what a dead process left there is restored from its checkpoint or gone), and a
dropped adapter's file goes with it.

LoRA dropout (`adapters.dropout`) is inert here: the trainer runs every forward in eval mode, as
the engine samples (flywheel/train/trainer.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)

from flywheel.config.actor import ActorConfig
from flywheel.config.adapters import AdaptersConfig
from flywheel.config.schema import TrainConfig
from flywheel.train.checkpoint import CheckpointFile, link_or_copy
from flywheel.train.schedule import make_scheduler


class AdapterSet:
    """Adapters by name on one frozen base model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: AdaptersConfig, actor: ActorConfig, train: TrainConfig):
        model.requires_grad_(False)
        self.model = model
        self.actor = actor
        self.train = train
        self.lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                               target_modules=config.target_modules, task_type="CAUSAL_LM")
        self.peft: PeftModel | None = None
        """Made with the first adapter (PEFT has no model without one)."""
        self.known: dict[str, None] = {}
        """Every adapter's name, in order of creation."""
        self.keys: dict[str, str] = {}
        """The adapters in the model: name -> PEFT's key, least recently used first."""
        self.spilled: dict[str, Path] = {}
        """The adapters kept on disk: name -> their file."""
        self.params: dict[str, list[torch.nn.Parameter]] = {}
        """Each adapter's LoRA weights, in the model's order."""
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.steps: dict[str, int] = {}
        """Optimizer steps each adapter took (its learning-rate schedule's position)."""
        self.revisions: dict[str, int] = {}
        """Each adapter's weights' revision: a number no other weights in this set had (`revision`)."""
        self._next_revision = 0
        self._next_key = 0
        self._bound = config.train_resident
        self.spill_dir: Path | None = None
        self.resident: int | None = None
        """The bound `trim` keeps to: None until `keep_on_disk`, or with `train_resident: null`."""

    def keep_on_disk(self, directory: Path) -> None:
        """Keep the adapters beyond `adapters.train_resident` in `directory`, emptied first: call it
        holding the run directory's lock (what is there is a dead trainer's)."""
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.spill_dir, self.resident = directory, self._bound

    def names(self) -> list[str]:
        return list(self.known)

    def __contains__(self, name: str) -> bool:
        return name in self.known

    def revision(self, name: str) -> int:
        """Which weights `name` has: the number changes with every step, load, restart or restore
        from a checkpoint (not when the adapter comes back from disk as it left), and is never
        given twice (what is measured of an adapter holds while its revision does)."""
        return self.revisions[name]

    def _changed(self, name: str) -> None:
        self.revisions[name] = self._next_revision
        self._next_revision += 1

    def ensure(self, name: str, origin: str | None = None) -> None:
        """Add `name`, unless it is here: a copy of `origin`'s weights when that adapter is here,
        else PEFT's initialisation; with a fresh optimizer."""
        if name in self.known:
            return
        self._create(name)
        self.known[name], self.steps[name] = None, 0
        self._changed(name)
        if origin is not None and origin in self.known and origin != name:
            self.load(name, self.weights(origin))

    def _create(self, name: str) -> None:
        """`name` into the model, with PEFT's initialisation and a fresh optimizer and schedule."""
        key = self.keys[name] = f"slot{self._next_key}"
        self._next_key += 1
        if self.peft is None:
            self.peft = get_peft_model(self.model, self.lora, adapter_name=key)
        else:
            self.peft.add_adapter(key, self.lora)
        suffix = f".{key}.weight"
        self.params[name] = [p for n, p in self.model.named_parameters() if n.endswith(suffix)]
        opt = self.actor.optimizer
        self.optimizers[name] = torch.optim.AdamW(self.params[name], lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        self.schedulers[name] = make_scheduler(self.optimizers[name], opt, self.train.max_steps)

    def drop(self, name: str) -> bool:
        """Remove `name`: its weights from the model (or its file), its optimizer and schedule (a
        forgotten user's adapter; `ensure` makes the name a new adapter again). Whether it was here."""
        if name not in self.known:
            return False
        del self.known[name], self.steps[name], self.revisions[name]
        if name in self.spilled:
            self.spilled.pop(name).unlink(missing_ok=True)
        else:
            self._remove(name)
        return True

    def _remove(self, name: str) -> None:
        """`name` out of the model, with its optimizer and schedule."""
        key = self.keys.pop(name)
        assert self.peft is not None
        if self.keys:
            self.peft.base_model.set_adapter(next(iter(self.keys.values())))  # not the one deleted (PEFT warns otherwise)
            self.peft.delete_adapter(key)
        else:  # PEFT keeps no model without an adapter: the model as it was, until the next one
            self.peft.unload()
            self.peft = None
        for held in (self.params, self.optimizers, self.schedulers):
            del held[name]

    def trim(self) -> None:
        """Keep at most `adapters.train_resident` adapters in the model: the least recently used
        others go to their files (see the module docstring)."""
        while self.resident is not None and len(self.keys) > self.resident:
            name = next(iter(self.keys))
            assert self.spill_dir is not None
            path = self.spill_dir / f"{name}.{uuid.uuid4().hex[:12]}.pt"
            torch.save(self._saved(name), path.with_suffix(".partial"))
            os.replace(path.with_suffix(".partial"), path)
            self._remove(name)
            self.spilled[name] = path

    def _here(self, name: str) -> str:
        """`name`'s PEFT key, the adapter brought back into the model if it was on disk; now its
        most recently used."""
        if name in self.spilled:
            path = self.spilled[name]
            saved = torch.load(path, weights_only=False)  # first: an adapter that cannot be read stays where it was
            del self.spilled[name]
            with torch.random.fork_rng(devices=[]):  # as `restore`: coming back draws no random numbers
                self._create(name)
            revision = self.revisions[name]
            self._restore(name, saved)
            self.revisions[name] = revision  # the same weights, back from disk
            path.unlink()
        self.keys[name] = self.keys.pop(name)
        return self.keys[name]

    def activate(self, name: str) -> None:
        """Make `name` the adapter of the following forward passes, and the only one with gradients."""
        key = self._here(name)
        assert self.peft is not None
        self.peft.base_model.set_adapter(key)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[torch.nn.Module]:
        """The model without any adapter: the frozen base."""
        if self.peft is None:
            yield self.model
            return
        with self.peft.disable_adapter():
            yield self.model

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """`name`'s tensors, keyed as PEFT's `save_pretrained` keys them (copies)."""
        return self._weights(self._here(name))

    def _weights(self, key: str) -> dict[str, torch.Tensor]:
        state = get_peft_model_state_dict(self.peft, adapter_name=key)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def load(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Set `name`'s weights (keyed as `weights` gives them), in place."""
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=self._here(name))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter {name}: tensors that do not fit the model: {unexpected[:5]}")
        self._changed(name)

    def restart(self, name: str, tensors: dict[str, torch.Tensor] | None = None, origin: str | None = None) -> None:
        """`name` back to `tensors` (a published version's, keyed as `weights` gives them), else
        to `origin`'s weights when that adapter is here, else to the base (LoRA's B at zero); its
        optimizer's moments cleared (its schedule goes on)."""
        if tensors is not None:
            self.load(name, tensors)
        elif origin is not None and origin in self.known and origin != name:
            self.load(name, self.weights(origin))
        else:
            key = self._here(name)
            with torch.no_grad():
                for param_name, param in self.model.named_parameters():
                    if param_name.endswith(f"lora_B.{key}.weight"):
                        param.zero_()
            self._changed(name)
        self.optimizers[name].state.clear()

    def config(self, name: str) -> dict[str, Any]:
        """`name`'s `adapter_config.json`, as PEFT's `save_pretrained` writes it."""
        key = self._here(name)
        assert self.peft is not None
        config = self.peft.peft_config[key].to_dict()
        config["inference_mode"] = True
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def zero_grad(self, names: list[str]) -> None:
        for name in names:
            self._here(name)
            self.optimizers[name].zero_grad(set_to_none=True)

    def clip_and_step(self, name: str) -> float:
        """Clip `name`'s gradient to `actor.optimizer.max_grad_norm`, step its optimizer; the norm."""
        self._here(name)
        norm = torch.nn.utils.clip_grad_norm_(self.params[name], self.actor.optimizer.max_grad_norm)
        self.optimizers[name].step()
        self._changed(name)
        return float(norm)

    def schedule(self, names: list[str]) -> float:
        """One learning-rate schedule step of each of `names`; their mean learning rate before it."""
        for name in names:
            self._here(name)
        lrs = [self.schedulers[name].get_last_lr()[0] for name in names]
        for name in names:
            self.schedulers[name].step()
            self.steps[name] += 1
        return sum(lrs) / len(lrs)

    def state(self) -> list[dict[str, Any]]:
        """Every adapter's weights, optimizer, schedule and steps, in order of creation; one kept
        on disk as its file."""
        return [{"name": name, "file": CheckpointFile(self.spilled[name]), "steps": self.steps[name]}
                if name in self.spilled else self._saved(name) for name in self.known]

    def _saved(self, name: str) -> dict[str, Any]:
        return {"name": name, "weights": self._weights(self.keys[name]), "optimizer": self.optimizers[name].state_dict(),
                "scheduler": self.schedulers[name].state_dict(), "steps": self.steps[name]}

    def restore(self, state: list[dict[str, Any]]) -> None:
        """Adapters as `state` left them (creating them draws no random numbers: the RNG stays
        where the checkpoint put it); one the checkpoint holds as a file stays on disk, a copy of
        it in this trainer's directory (read into the model where there is none)."""
        with torch.random.fork_rng(devices=[]):
            for saved in state:
                name = saved["name"]
                self.known[name], self.steps[name] = None, saved["steps"]
                self._changed(name)
                if "file" in saved and self.spill_dir is not None:
                    self.spilled[name] = self.spill_dir / saved["file"].path.name
                    link_or_copy(saved["file"].path, self.spilled[name])
                    continue
                self._create(name)
                self._restore(name, torch.load(saved["file"].path, weights_only=False) if "file" in saved else saved)
        self.trim()

    def _restore(self, name: str, saved: dict[str, Any]) -> None:
        """`name` (in the model) as `saved` (a `_saved`) left it."""
        self.load(name, saved["weights"])
        self.optimizers[name].load_state_dict(saved["optimizer"])
        self.schedulers[name].load_state_dict(saved["scheduler"])
        self.steps[name] = saved["steps"]
