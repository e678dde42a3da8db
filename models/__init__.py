"""Models: naming, building, loading and saving checkpoints, and the versioned weight store.

Shared by every loop (with `bus/`): the serve engine and the trainer load models through
`load_model`; the trainer publishes weights with `WeightStore.publish`, and the server swaps them
in with `load_weights`.

The names below are imported on first use, so that `models.cache` (where built things are
cached, atomically) can be used by code that must not load torch (the SWE task machinery).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "atomic_directory": "models.cache",
    "cache_root": "models.cache",
    "cached_build": "models.cache",
    "load_model": "models.registry",
    "place": "models.registry",
    "resolve_model": "models.registry",
    "save_model": "models.registry",
    "import_smollm2": "models.smollm2",
    "build_tiny": "models.tiny",
    "WeightStore": "models.weight_store",
    "load_weights": "models.weight_store",
}
__all__ = [
    "WeightStore", "atomic_directory", "build_tiny", "cache_root", "cached_build", "import_smollm2", "load_model",
    "load_weights", "place", "resolve_model", "save_model",
]

if TYPE_CHECKING:
    from models.cache import atomic_directory, cache_root, cached_build
    from models.registry import load_model, place, resolve_model, save_model
    from models.smollm2 import import_smollm2
    from models.tiny import build_tiny
    from models.weight_store import WeightStore, load_weights


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
