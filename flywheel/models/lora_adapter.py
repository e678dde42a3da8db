"""A LoRA adapter on disk, in PEFT's directory format, and read into memory for serving.

The format is what PEFT's `save_pretrained` writes and what vLLM (`--lora-modules`,
`/v1/load_lora_adapter`) and SGLang (`--lora-paths`, `/load_lora_adapter`) load, so one
directory serves on any of the three engines:

- `adapter_config.json`: `peft_type: "LORA"`, `r`, `lora_alpha`, `use_rslora`, `target_modules`
  (and many more keys, most of them for training);
- `adapter_model.safetensors`: for each adapted linear layer `<module>` of the base model (its path
  in the model, e.g. `model.layers.0.self_attn.q_proj`), `base_model.model.<module>.lora_A.weight`
  [r, in features] and `base_model.model.<module>.lora_B.weight` [out features, r].

A layer's output becomes `W x + s · B (A x)` with the scaling `s = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). `read_adapter` returns each layer's A and B with `s`
folded into B, the rank of each read from its tensors (so PEFT's per-layer `rank_pattern` needs
nothing more).

What a plain low-rank product cannot serve is refused with an `AdapterError` naming it, never
served wrong: DoRA, LoRA biases, per-layer `alpha_pattern`, activated LoRA, layer replication,
and any tensor other than `lora_A`/`lora_B` weights (adapted embeddings, `modules_to_save`,
trainable tokens); so are weights that are not finite (a diverged training run's), which a batched
product would spread to other adapters' rows (0 x inf). Which layers an engine can adapt is the
engine's business (`flywheel.models.lora_batch.AdapterTable.check`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from flywheel.torch_threads import one_thread

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
UNSUPPORTED_WHEN_SET = ("use_dora", "lora_bias", "alpha_pattern", "alora_invocation_tokens", "layer_replication",
                        "modules_to_save", "trainable_token_indices", "use_qalora", "fan_in_fan_out")
"""Config keys whose value, when set (true, non-empty), changes the model in a way a low-rank
product over the listed layers does not reproduce."""


class AdapterError(ValueError):
    """A directory that is not a LoRA adapter this code can serve; the message says why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's low-rank matrices, ready to add to the base model's products."""

    path: Path
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per adapted linear layer (its path in the base model): A [rank, in features] and
    B [out features, rank] with the scaling folded in."""

    @property
    def rank(self) -> int:
        """The largest rank of its layers."""
        return max(a.shape[0] for a, _ in self.layers.values())


def read_adapter(path: str | Path) -> LoraAdapter:
    """The adapter in the PEFT directory `path` (see the module docstring); raises `AdapterError`
    when there is none there or it cannot be served."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(path / WEIGHTS_FILE)
    except FileNotFoundError as exc:
        raise AdapterError(f"{path} is not a LoRA adapter directory: no {Path(exc.filename).name}") from None
    except (OSError, ValueError, RuntimeError) as exc:  # unreadable, bad JSON, a corrupt safetensors file
        raise AdapterError(f"cannot read the adapter in {path}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type must be LORA, got {config.get('peft_type') if isinstance(config, dict) else config!r}")
    unsupported = [key for key in UNSUPPORTED_WHEN_SET if config.get(key)]
    if unsupported:
        raise AdapterError(f"{path}: adapters with {', '.join(unsupported)} are not supported")
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    with one_thread():  # read beside a decoding engine (`flywheel.torch_threads`)
        return LoraAdapter(path, _layers(path, tensors, alpha, rslora))


def _layers(path: Path, tensors: dict[str, torch.Tensor], alpha: float,
            rslora: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    names = set()
    for key in tensors:
        if not (key.startswith(KEY_PREFIX) and key.endswith((A_SUFFIX, B_SUFFIX))):
            raise AdapterError(f"{path}: tensor {key} is not a LoRA A or B weight (not supported)")
        names.add(key[len(KEY_PREFIX):-len(A_SUFFIX)])
    if not names:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    layers = {}
    for name in sorted(names):
        a, b = tensors.get(KEY_PREFIX + name + A_SUFFIX), tensors.get(KEY_PREFIX + name + B_SUFFIX)
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {name} needs lora_A [r, in] and lora_B [out, r] weights")
        if not (a.isfinite().all() and b.isfinite().all()):  # 0 x inf in a batched product would reach other rows
            raise AdapterError(f"{path}: {name}'s weights are not all finite (inf or NaN)")
        rank = a.shape[0]
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        layers[name] = (a, b * scaling)
    return layers
