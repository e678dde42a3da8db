"""Models: naming, building, loading and saving checkpoints, and the versioned weight store.

Shared by every loop (with `flywheel/bus/`): the serve engine and the trainer load models through
`load_model`; the trainer publishes weights with `WeightStore.publish`, and the server swaps them
in with `load_weights`. LoRA adapters: `lora_adapter` reads PEFT's directory format, `lora_batch`
serves many adapters in one batch, `adapter_store` keeps the versions the trainer publishes
(imported from their modules).

The names below are imported on first use, so that `flywheel.models.cache` (where built things are
cached, atomically) can be used by code that must not load torch (the SWE task machinery).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "atomic_directory": "flywheel.models.cache",
    "cache_root": "flywheel.models.cache",
    "cached_build": "flywheel.models.cache",
    "load_model": "flywheel.models.checkpoints",
    "place": "flywheel.models.checkpoints",
    "resolve_model": "flywheel.models.checkpoints",
    "save_model": "flywheel.models.checkpoints",
    "import_smollm2": "flywheel.models.smollm2",
    "build_tiny": "flywheel.models.tiny",
    "WeightStore": "flywheel.models.weight_store",
    "load_weights": "flywheel.models.weight_store",
}
__all__ = [
    "WeightStore", "atomic_directory", "build_tiny", "cache_root", "cached_build", "import_smollm2", "load_model",
    "load_weights", "place", "resolve_model", "save_model",
]

if TYPE_CHECKING:
    from flywheel.models.cache import atomic_directory, cache_root, cached_build
    from flywheel.models.checkpoints import load_model, place, resolve_model, save_model
    from flywheel.models.smollm2 import import_smollm2
    from flywheel.models.tiny import build_tiny
    from flywheel.models.weight_store import WeightStore, load_weights


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
