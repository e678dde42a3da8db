"""The embedded engine's side of LoRA adapters (`adapters.Adapters`): loading and unloading
them between two steps, a request's hold on its adapter's slot from its admission until it
leaves, and the adapter rows (`flywheel.models.lora_batch.Rows`) of each forward.

`AdapterCommands` is a part of `Engine`, kept in its own file (as `admission.Admission` is): it
uses the engine's adapters and its command queue; all but `load_adapter` and
`unload_adapter` run on the engine's thread.
"""

from __future__ import annotations

import asyncio
import logging

from flywheel.models.lora_adapter import AdapterError, LoraAdapter, read_adapter
from flywheel.models.lora_batch import Rows
from flywheel.serve.engine.request import Request

log = logging.getLogger(__name__)


class AdapterCommands:
    """The engine's adapter commands and rows (see the module docstring)."""

    async def load_adapter(self, name: str, path: str, label: str | None = None) -> dict[str, str]:
        """Serve the PEFT adapter in `path` as `name`'s new version (labelled `label`, else
        counted), from the next step on; returns {name: directory} of the adapters loaded.
        Raises `AdapterError` for a name or directory that cannot be served."""
        self.adapters.valid_name(name)
        adapter = await asyncio.to_thread(read_adapter, path)
        self.adapters.table.check(adapter)
        return await self._command("load_adapter", lora_name=name, adapter=adapter, label=label)

    async def unload_adapter(self, name: str) -> dict[str, str]:
        """Stop serving `name` to new requests (those that hold it finish with it); returns the
        adapters still loaded. Raises `UnknownAdapter` for a name not loaded."""
        return await self._command("unload_adapter", lora_name=name)

    def _do_load_adapter(self, lora_name: str, adapter: LoraAdapter, label: str | None) -> dict[str, str]:
        self.adapters.register(lora_name, adapter, label)
        log.info("adapter %s loaded from %s", lora_name, adapter.path)
        return self.adapters.loaded()

    def _do_unload_adapter(self, lora_name: str) -> dict[str, str]:
        self.adapters.unregister(lora_name)
        return self.adapters.loaded()

    def _hold_adapter(self, request: Request) -> bool:
        """Whether `request` may be admitted now: it names no adapter, or holds its slot (taken now
        if need be). One whose adapter cannot be read is admitted to fail."""
        if request.adapter is None or request.lora is not None or request.error is not None:
            return True
        try:
            request.lora = self.adapters.acquire(request.adapter)
        except AdapterError as exc:
            request.mark_failed(f"its adapter cannot be served: {exc}")
            return True
        return request.lora is not None

    def _leave(self, request: Request) -> None:
        """`request` leaves the engine: it holds its adapter's slot no longer."""
        if request.lora is not None:
            self.adapters.release(request.lora)
            request.lora = None

    def _lora(self, requests: list[Request]) -> Rows | None:
        """The adapter slots of a forward whose rows are `requests`; None when none has one."""
        return self.adapters.table.rows([r.lora.slot if r.lora is not None else 0 for r in requests])
