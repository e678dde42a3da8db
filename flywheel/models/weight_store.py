"""The versioned weight store: checkpoints the trainer publishes and the server swaps to.

Layout under `root`: one directory per version, `v{N}/`, holding what `save_pretrained` writes
(config.json, generation_config.json, model.safetensors), the tokenizer when one is given, and
`meta.json` ({version, created_at, n_bytes, tied}). Each is a loadable Hugging Face model directory,
so SGLang's `/update_weights_from_disk` can take it as it is.

A version appears all at once: it is written into `root/.tmp-v{N}-<random>/`, fsynced and renamed
to `v{N}`, so a reader that sees `v{N}` sees all of it. Old versions are pruned (renamed away, then
deleted) so that at most `keep` remain, besides the `protected` ones; a reader holding an old path
should fall back to `latest()`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.models.cache import TMP_PREFIX, atomic_directory
from flywheel.models.checkpoints import resolve_model

VERSION_DIR = re.compile(r"v(0|[1-9][0-9]*)")
META_FILE = "meta.json"
# A temporary directory this old belongs to a writer that died: a live one finishes sooner.
STALE_TMP_S = 600.0


def _saved_keys(directory: Path) -> set[str]:
    keys: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def _tied_aliases(model: torch.nn.Module, saved: set[str]) -> dict[str, str]:
    """{name left out of the files: saved name sharing its storage}, e.g. a tied lm_head."""
    state = model.state_dict()
    owners = {(t.data_ptr(), t.shape): name for name, t in state.items() if name in saved}
    return {
        name: owners[(t.data_ptr(), t.shape)]
        for name, t in state.items()
        if name not in saved and (t.data_ptr(), t.shape) in owners
    }


class WeightStore:
    """Versioned checkpoints under `root`, keeping the newest `keep` of them."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.protected: set[int] = set()
        """Versions never pruned, beyond the newest `keep` (those serving under promotion)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for entry in self.root.glob(f"{TMP_PREFIX}*"):
            try:
                stale = entry.stat().st_mtime < cutoff
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(entry, ignore_errors=True)

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def versions(self) -> list[int]:
        """Published versions, oldest first."""
        found = []
        for entry in self.root.iterdir():
            match = VERSION_DIR.fullmatch(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest published version, or None if there is none."""
        versions = self.versions()
        return versions[-1] if versions else None

    def path(self, version: int) -> Path:
        """The directory of `version`; `FileNotFoundError` if it is not (or no longer) there."""
        directory = self._dir(version)
        if not directory.is_dir():
            raise FileNotFoundError(
                f"weight version {version} is not in {self.root} (have {self.versions()})"
            )
        return directory

    def meta(self, version: int) -> dict:
        """The `meta.json` of `version`."""
        return json.loads((self.path(version) / META_FILE).read_text())

    def publish(
        self,
        model: PreTrainedModel,
        version: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Path:
        """Write `model` (and `tokenizer`) as `version`, atomically, then prune old versions.

        Raises `FileExistsError` if `version` was already published.
        """
        if version < 0:
            raise ValueError(f"version must be non-negative, got {version}")
        dest = self._dir(version)
        if dest.exists():
            raise FileExistsError(f"weight version {version} is already published in {self.root}")
        with atomic_directory(dest) as tmp:
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            meta = {
                "version": version,
                "created_at": time.time(),
                "n_bytes": sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
                "tied": _tied_aliases(model, _saved_keys(tmp)),
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        self._prune(published=version)
        return dest

    def _prune(self, published: int) -> None:
        others = [v for v in self.versions() if v != published and v not in self.protected]
        for version in others[: max(0, len(others) + 1 - self.keep)]:
            self._remove(version)

    def _remove(self, version: int) -> None:
        # Rename first, so that no reader ever lists a half-deleted version.
        doomed = self.root / f"{TMP_PREFIX}deleted-v{version}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self._dir(version), doomed)
        except FileNotFoundError:
            return  # another process removed it first
        shutil.rmtree(doomed, ignore_errors=True)

    def load_state_dict(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of `version`, ready for `model.load_state_dict` on the same architecture.

        Names left out of the files because they share storage with another (tied embeddings) are
        put back, pointing at the same tensor, so a strict load succeeds.
        """
        state = _read_safetensors(self.path(version))
        for alias, name in self.meta(version)["tied"].items():
            state[alias] = state[name]
        return state


def _weights_dir(path: str | os.PathLike[str]) -> Path:
    """The directory `path` names: itself when it is one, else a model name resolved."""
    directory = Path(path).expanduser()
    if directory.is_dir() or not isinstance(path, str):
        return directory
    try:  # a name: built or converted into the cache once, as at launch
        return resolve_model(path)
    except ValueError:
        return directory  # neither: reading it says what is missing


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Copy the weights saved in the model directory `path` into `model`, in place.

    `path` is a weight-store version or any safetensors checkpoint of the same architecture, or a
    model's name (`tiny`, `smollm2-135m`), resolved as the engine resolved it at launch: SGLang
    reloads whatever it was launched with, and `/model_info` reports that name. The
    model's parameter objects are kept (an optimizer or engine holding them sees the new values);
    tied tensors left out of the files are filled through their tie. Raises `ValueError`, before
    changing anything, if the files do not match the model's tensors by name and shape.
    """
    state = _read_safetensors(_weights_dir(path))
    expected = model.state_dict()
    tied = _tied_aliases(model, set(state))
    missing = sorted(set(expected) - set(state) - set(tied))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(k for k in state.keys() & expected.keys() if state[k].shape != expected[k].shape)
    if missing or unexpected or mismatched:
        raise ValueError(
            f"the weights in {path} do not fit this {type(model).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {mismatched[:5]}"
        )
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
