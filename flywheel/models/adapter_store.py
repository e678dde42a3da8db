"""The versioned adapter store: the LoRA adapters the trainer publishes and the engines load.

Layout under `root`: one directory per adapter, `<name>/`, and in it one per version, `v{N}/`,
holding an adapter in PEFT's directory format (flywheel/models/lora_adapter.py):
`adapter_config.json` and `adapter_model.safetensors`, the tensors keyed exactly as PEFT's
`save_pretrained` keys them (`base_model.model.<module>.lora_A.weight`, ...). Only the adapter:
megabytes, not the model. Versions count per adapter.

A version appears all at once (written aside, fsynced, renamed: `atomic_directory`). The newest
`keep` versions of each adapter are kept, and those `protected` (what serves under promotion).
`delete(name)` removes an adapter with all its
versions (how a user's learned behaviour is forgotten); its directory is renamed away first, so
no reader lists half of it. `forget(tenant, user)` deletes the adapters of a forgotten tenant or
user (`owned_by`: a user's own adapter; a tenant's adapter and all its users').
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from flywheel.models.adapter_names import SHARED, user_adapter
from flywheel.models.cache import TMP_PREFIX, atomic_directory
from flywheel.models.lora_adapter import CONFIG_FILE, WEIGHTS_FILE

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
"""An adapter's name (flywheel/models/adapter_names.py); never starting with `.`, so that no name
is `..` or a temporary directory's."""
VERSION_DIR = re.compile(r"v(0|[1-9][0-9]*)")
DROPPED = "forget.adapters"
"""The audit action by which the trainer says it dropped a forgotten tenant's or user's adapters
(flywheel/train/forget_adapters.py; every gateway unloads them again on it)."""


def valid_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"not an adapter name: {name!r} (letters, digits, '.', '_', '-'; not starting with '.')")
    return name


def owned_by(names: Iterable[str], tenant: str, user: str | None) -> list[str]:
    """Those of `names` that forgetting `tenant` (or its end user `user`) removes: the user's own
    adapter (`user_adapter`), or the tenant's adapter and every one of its users' (`<tenant>.`...;
    never another tenant's, such as `<tenant>2`'s). The deployment's `shared` adapter is nobody's,
    also not a tenant's named so before that name was reserved."""
    if user is not None:
        return [name for name in names if name == user_adapter(tenant, user)]
    return [name for name in names if name != SHARED and (name == tenant or name.startswith(f"{tenant}."))]


class AdapterStore:
    """Adapters' versions under `root`, keeping the newest `keep` of each."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.protected: dict[str, set[int]] = {}
        """Versions never pruned, by adapter: those that serve, under promotion."""
        self.root.mkdir(parents=True, exist_ok=True)

    def names(self) -> list[str]:
        """The adapters with at least one version, sorted."""
        return sorted(p.name for p in self.root.iterdir() if NAME.fullmatch(p.name) and self.versions(p.name))

    def versions(self, name: str) -> list[int]:
        """`name`'s published versions, oldest first."""
        directory = self.root / valid_name(name)
        if not directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in directory.iterdir() if (m := VERSION_DIR.fullmatch(p.name)) and p.is_dir())

    def latest(self, name: str) -> int | None:
        versions = self.versions(name)
        return versions[-1] if versions else None

    def path(self, name: str, version: int) -> Path:
        """The directory of `name`'s `version`; `FileNotFoundError` if it is not (or no longer) there."""
        directory = self.root / valid_name(name) / f"v{version}"
        if not directory.is_dir():
            raise FileNotFoundError(f"adapter {name} has no version {version} in {self.root} (have {self.versions(name)})")
        return directory

    def publish(self, name: str, version: int, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
        """Write `name`'s `version`: its PEFT config (a dict, as `adapter_config.json` holds it) and
        its tensors (keyed as PEFT saves them), atomically; then prune its old versions. Raises
        `FileExistsError` if that version is there already."""
        if version < 0:
            raise ValueError(f"version must be non-negative, got {version}")
        dest = self.root / valid_name(name) / f"v{version}"
        with atomic_directory(dest) as tmp:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
            save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        for old in sorted(set(self.versions(name)[: -self.keep]) - self.protected.get(name, set())):
            self._remove(self.root / name / f"v{old}", self.root / name)
        return dest

    def delete_version(self, name: str, version: int) -> bool:
        """Remove `name`'s `version`; whether it was there."""
        return self._remove(self.root / valid_name(name) / f"v{version}", self.root / valid_name(name))

    def delete(self, name: str) -> bool:
        """Remove `name` and all its versions; whether there was anything to remove."""
        return self._remove(self.root / valid_name(name), self.root)

    def forget(self, tenant: str, user: str | None) -> list[str]:
        """Delete the adapters of `tenant` (or of its end user `user`: `owned_by`); the ones deleted."""
        return [name for name in owned_by(self.names(), tenant, user) if self.delete(name)]

    @staticmethod
    def _remove(directory: Path, parent: Path) -> bool:
        doomed = parent / f"{TMP_PREFIX}deleted-{directory.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(directory, doomed)
        except FileNotFoundError:
            return False  # not there, or another process removed it first
        shutil.rmtree(doomed, ignore_errors=True)
        return True
