"""The embedded engine's LoRA adapters: the names it serves, their versions, and which of them
are resident in the slots of its `AdapterTable` (`flywheel.models.lora_batch`).

A request names an adapter (SGLang's `lora_path`) or none (the bare base). A name is either
registered (`register`: SGLang's `/load_lora_adapter`, a name and a PEFT directory) or, if not,
the directory `root/<name>` (`serve.lora_root`) when it holds an adapter; any other name is
unknown (`UnknownAdapter`, SGLang's message). Names are plain (letters, digits, `.`, `_`, `-`),
so that one can never reach outside the root.

Residency: the table has `slots` slots (`serve.max_loras`), kept least recently used first. An
adapter is read from its directory into a slot when a request that names it is admitted and it
is not resident (`acquire`), taking a free slot or evicting the least recently used adapter that
no request holds; an evicted adapter is read from disk again on its next use. Every request
holds (pins) its adapter's slot from its admission until it leaves the engine (`release`), so a
slot is never taken from under a running, part-prefilled or retracted request; when every slot
is held, `acquire` returns None and the request waits in the queue.

Versions: each load of a name is a new version, labelled with the label the load gives, else
the count of that name's versions in this engine (1, 2, ...); reading an evicted adapter again
finds its weights file as it was (the same modification time and size: the same version) or
changed (a new version, counted). A token
sampled with an adapter carries `<name>@<label>` (`Resident.version`), e.g. `alice@3`. Loading a
new version of a resident adapter writes it into the same slot, between two decode steps: rows
that use it take the new version from their next token on, their cache as it was (as an
in-place weight swap), and report it. `unregister` (SGLang's `/unload_lora_adapter`) forgets a
name at once: requests that name it from then on are refused, and those that wait for a slot
fail when admitted, unless the root holds an adapter of that name (then served as a new
version); the requests that hold it finish with it, and its slot is freed when the last of them
leaves. So unloading then loading a name (SGLang's way to replace an adapter) lets the
requests under way finish with the old version, and loading over it moves them to the new one.

Everything but `valid_name`, `require`, `loaded` and `resident` runs on the engine's thread,
between steps.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from flywheel.models.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    LoraAdapter,
    read_adapter,
)
from flywheel.models.lora_batch import AdapterTable

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UnknownAdapter(AdapterError):
    """A request named an adapter that is neither registered nor under the adapter root."""


@dataclass
class Source:
    """Where a name's adapter is read from, and which version that is."""

    path: Path
    label: str | None = None
    """None until it is first read."""
    files: tuple[int, int] | None = None
    """(modification time in ns, size) of its weights file when it was last read."""


@dataclass
class Resident:
    """An adapter in a slot of the table."""

    name: str
    slot: int
    version: str
    """`<name>@<label>`: the version whose weights the slot holds."""
    holders: int = 0
    """Requests in the engine that use it."""


class Adapters:
    """The engine's adapters (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, slots: int, root: str | Path | None = None):
        self.table = AdapterTable(model, slots)
        self.root = Path(root) if root else None
        self._sources: dict[str, Source] = {}
        self._versions: Counter[str] = Counter()
        self._resident: OrderedDict[str, Resident] = OrderedDict()
        self._free = list(range(1, slots + 1))
        """Free slots, a heap: the lowest is taken first, so that a table holding fewer adapters
        than it has slots keeps them in its first ones (a batch's products read the slots up to the
        highest it uses: `lora_batch`)."""

    def valid_name(self, name: object) -> None:
        """Raise `AdapterError` unless `name` may name an adapter here."""
        if not self.table.slots:
            raise AdapterError("this engine serves no adapters (serve.max_loras is 0)")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise AdapterError(f"{name!r} is not an adapter name: letters, digits, '.', '_' and '-', at most 128")

    def require(self, name: str) -> None:
        """Raise `UnknownAdapter` unless `name` is registered or an adapter under the root."""
        try:
            self.valid_name(name)
        except AdapterError as exc:
            raise UnknownAdapter(self._unknown(name, f" ({exc})")) from None
        if name not in self._sources and self._under_root(name) is None:
            raise UnknownAdapter(self._unknown(name))

    def loaded(self) -> dict[str, str]:
        """{name: directory} of the registered names, and of those found under the root so far."""
        sources = dict(self._sources)  # one atomic copy: another thread may be changing them
        return {name: str(source.path) for name, source in sources.items()}

    def resident(self) -> list[str]:
        """The adapters in the table's slots, least recently used first."""
        return list(self._resident)

    # ---- the engine's thread ------------------------------------------------------------------

    def register(self, name: str, adapter: LoraAdapter, label: str | None = None) -> None:
        """Serve `adapter` (read and checked) as `name`'s new version, labelled `label` (else
        counted); a resident `name` takes it in its slot, another goes into a free or evictable
        slot if there is one (else it is read again on first use)."""
        self.valid_name(name)
        source = self._sources[name] = Source(adapter.path, label or self._count(name), _files(adapter.path))
        entry = self._resident.get(name)
        if entry is None:
            slot = self._slot()
            if slot is None:
                return
            entry = self._resident[name] = Resident(name, slot, "")
        self._write(entry, adapter, source)

    def unregister(self, name: str) -> None:
        """Forget `name` (see the module docstring); raises `UnknownAdapter` for a name not loaded."""
        if not isinstance(name, str) or self._sources.pop(name, None) is None:
            raise UnknownAdapter(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._names()}")
        entry = self._resident.pop(name, None)
        if entry is not None and not entry.holders:
            heapq.heappush(self._free, entry.slot)

    def acquire(self, name: str) -> Resident | None:
        """Hold `name`'s slot for a request, reading the adapter into one if it is not resident;
        None when every slot is held. Raises `AdapterError` when it is unknown or unreadable."""
        entry = self._resident.get(name)
        if entry is None:
            source = self._sources.get(name) or Source(self._root_path(name))
            slot = self._slot()
            if slot is None:
                return None
            try:
                adapter = read_adapter(source.path)
                self.table.check(adapter)
            except AdapterError:
                heapq.heappush(self._free, slot)
                raise
            files = _files(source.path)
            if source.label is None or files != source.files:  # first read, or changed since: a new version
                source.label, source.files = self._count(name), files
            self._sources[name] = source
            entry = self._resident[name] = Resident(name, slot, "")
            self._write(entry, adapter, source)
        self._resident.move_to_end(name)
        entry.holders += 1
        return entry

    def release(self, entry: Resident) -> None:
        """A request holding `entry` left the engine; an unregistered adapter's slot is freed
        with its last holder."""
        entry.holders -= 1
        if not entry.holders and self._resident.get(entry.name) is not entry:
            heapq.heappush(self._free, entry.slot)

    # ---- helpers -------------------------------------------------------------------------------

    def _write(self, entry: Resident, adapter: LoraAdapter, source: Source) -> None:
        self.table.write(entry.slot, adapter)
        entry.version = f"{entry.name}@{source.label}"

    def _slot(self) -> int | None:
        """A free slot, evicting the least recently used adapter no request holds if need be."""
        if not self._free:
            idle = next((entry for entry in self._resident.values() if not entry.holders), None)
            if idle is None:
                return None
            self._evict(idle)
        return heapq.heappop(self._free)

    def _evict(self, entry: Resident) -> None:
        del self._resident[entry.name]
        heapq.heappush(self._free, entry.slot)

    def _root_path(self, name: str) -> Path:
        path = self._under_root(name)
        if path is None:
            raise UnknownAdapter(self._unknown(name))
        return path

    def _under_root(self, name: str) -> Path | None:
        if self.root is None or not (self.root / name / CONFIG_FILE).is_file():
            return None
        return self.root / name

    def _count(self, name: str) -> str:
        self._versions[name] += 1
        return str(self._versions[name])

    def _names(self) -> list[str]:
        return sorted(self._sources)

    def _unknown(self, name: str, why: str = "") -> str:
        return f"The following requested LoRA adapters are not loaded: {name}{why}\nLoaded adapters: {self._names()}."


def _files(path: Path) -> tuple[int, int] | None:
    try:
        stat = (path / WEIGHTS_FILE).stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size
