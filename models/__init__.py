"""Models: naming, building, loading and saving checkpoints, and the versioned weight store.

Shared by every loop (with `bus/`): the serve engine and the trainer load models through
`load_model`; the trainer publishes weights with `WeightStore.publish`, and the server swaps them
in with `load_weights`.
"""

from models.cache import atomic_directory, cache_root, cached_build
from models.registry import load_model, place, resolve_model, save_model
from models.smollm2 import import_smollm2
from models.tiny import build_tiny
from models.weight_store import WeightStore, load_weights

__all__ = [
    "WeightStore",
    "atomic_directory",
    "build_tiny",
    "cache_root",
    "cached_build",
    "import_smollm2",
    "load_model",
    "place",
    "load_weights",
    "resolve_model",
    "save_model",
]
