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

LoRA dropout (`adapters.dropout`) is inert here: the trainer runs every forward in eval mode, as
the engine samples (flywheel/train/trainer.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)

from flywheel.config.adapters import AdaptersConfig
from flywheel.config.schema import ActorConfig, TrainConfig
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
        self.keys: dict[str, str] = {}
        """Name -> PEFT's key of the adapter, in order of creation."""
        self.params: dict[str, list[torch.nn.Parameter]] = {}
        """Each adapter's LoRA weights, in the model's order."""
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.steps: dict[str, int] = {}
        """Optimizer steps each adapter took (its learning-rate schedule's position)."""
        self._next_key = 0

    def names(self) -> list[str]:
        return list(self.keys)

    def ensure(self, name: str, origin: str | None = None) -> None:
        """Add `name`, unless it is here: a copy of `origin`'s weights when that adapter is here,
        else PEFT's initialisation; with a fresh optimizer."""
        if name in self.keys:
            return
        key = self.keys[name] = f"slot{self._next_key}"
        self._next_key += 1
        if self.peft is None:
            self.peft = get_peft_model(self.model, self.lora, adapter_name=key)
        else:
            self.peft.add_adapter(key, self.lora)
        if origin is not None and origin in self.keys and origin != name:
            self.load(name, self.weights(origin))
        suffix = f".{key}.weight"
        self.params[name] = [p for n, p in self.model.named_parameters() if n.endswith(suffix)]
        opt = self.actor.optimizer
        self.optimizers[name] = torch.optim.AdamW(self.params[name], lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        self.schedulers[name] = make_scheduler(self.optimizers[name], opt, self.train.max_steps)
        self.steps[name] = 0

    def drop(self, name: str) -> bool:
        """Remove `name`: its weights from the model, its optimizer and schedule (a forgotten user's
        adapter; `ensure` makes the name a new adapter again). Whether it was here."""
        key = self.keys.pop(name, None)
        if key is None:
            return False
        assert self.peft is not None
        if self.keys:
            self.activate(next(iter(self.keys)))  # not the one deleted (PEFT warns, and picks one itself)
            self.peft.delete_adapter(key)
        else:  # PEFT keeps no model without an adapter: the model as it was, until the next one
            self.peft.unload()
            self.peft = None
        for held in (self.params, self.optimizers, self.schedulers, self.steps):
            del held[name]
        return True

    def activate(self, name: str) -> None:
        """Make `name` the adapter of the following forward passes, and the only one with gradients."""
        assert self.peft is not None
        self.peft.base_model.set_adapter(self.keys[name])

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
        state = get_peft_model_state_dict(self.peft, adapter_name=self.keys[name])
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def load(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Set `name`'s weights (keyed as `weights` gives them), in place."""
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=self.keys[name])
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter {name}: tensors that do not fit the model: {unexpected[:5]}")

    def restart(self, name: str, tensors: dict[str, torch.Tensor] | None = None, origin: str | None = None) -> None:
        """`name` back to `tensors` (a published version's, keyed as `weights` gives them), else
        to `origin`'s weights when that adapter is here, else to the base (LoRA's B at zero); its
        optimizer's moments cleared (its schedule goes on)."""
        if tensors is not None:
            self.load(name, tensors)
        elif origin is not None and origin in self.keys and origin != name:
            self.load(name, self.weights(origin))
        else:
            with torch.no_grad():
                for param_name, param in self.model.named_parameters():
                    if param_name.endswith(f"lora_B.{self.keys[name]}.weight"):
                        param.zero_()
        self.optimizers[name].state.clear()

    def config(self, name: str) -> dict[str, Any]:
        """`name`'s `adapter_config.json`, as PEFT's `save_pretrained` writes it."""
        assert self.peft is not None
        config = self.peft.peft_config[self.keys[name]].to_dict()
        config["inference_mode"] = True
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def zero_grad(self, names: list[str]) -> None:
        for name in names:
            self.optimizers[name].zero_grad(set_to_none=True)

    def clip_and_step(self, name: str) -> float:
        """Clip `name`'s gradient to `actor.optimizer.max_grad_norm`, step its optimizer; the norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params[name], self.actor.optimizer.max_grad_norm)
        self.optimizers[name].step()
        return float(norm)

    def schedule(self, names: list[str]) -> float:
        """One learning-rate schedule step of each of `names`; their mean learning rate before it."""
        lrs = [self.schedulers[name].get_last_lr()[0] for name in names]
        for name in names:
            self.schedulers[name].step()
            self.steps[name] += 1
        return sum(lrs) / len(lrs)

    def state(self) -> list[dict[str, Any]]:
        """Every adapter's weights, optimizer, schedule and steps, in order of creation."""
        return [{"name": name, "weights": self.weights(name), "optimizer": self.optimizers[name].state_dict(),
                 "scheduler": self.schedulers[name].state_dict(), "steps": self.steps[name]} for name in self.keys]

    def restore(self, state: list[dict[str, Any]]) -> None:
        """Adapters as `state` left them (creating them draws no random numbers: the RNG stays
        where the checkpoint put it)."""
        with torch.random.fork_rng(devices=[]):
            for saved in state:
                self.ensure(saved["name"])
                self.load(saved["name"], saved["weights"])
                self.optimizers[saved["name"]].load_state_dict(saved["optimizer"])
                self.schedulers[saved["name"]].load_state_dict(saved["scheduler"])
                self.steps[saved["name"]] = saved["steps"]
