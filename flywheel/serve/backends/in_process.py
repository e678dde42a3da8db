"""The embedded engine in the gateway's process: the same `/generate` bodies and chunks the
engine's HTTP server takes and gives (`flywheel.serve.engine.native`), handed over without the socket, with
the engine's exact per-token versions (an adapter's tokens: `<name>@<N>`, N the adapter version
`load_adapter` loaded)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from flywheel.models.lora_adapter import AdapterError
from flywheel.serve.backends.base import EngineError
from flywheel.serve.engine import (
    Engine,
    ProtocolError,
    RequestFailed,
    generate,
    generate_stream,
)
from flywheel.serve.engine.adapters import UnknownAdapter
from flywheel.serve.engine_choice import version_of


class InProcessEngineClient:
    """An embedded `Engine` in this process."""

    def __init__(self, engine: Engine, name: str = "embedded"):
        self.engine = engine
        self.name = name

    @property
    def weight_version(self) -> int:
        return version_of(self.engine.version)

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await generate(self.engine, body)
        except ProtocolError as exc:
            raise EngineError(400, str(exc)) from None
        except RequestFailed as exc:
            raise EngineError(500, str(exc)) from None

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in generate_stream(self.engine, body, incremental=True):
                yield chunk
        except ProtocolError as exc:
            raise EngineError(400, str(exc)) from None
        except RequestFailed as exc:
            raise EngineError(500, str(exc)) from None

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self.engine.update_weights(model_path, str(weight_version))

    async def load_adapter(self, name: str, path: str, version: int) -> None:
        """Serve the PEFT adapter in `path` as version `version` of adapter `name` (labelled
        `str(version)`), from the next decode step on."""
        try:
            await self.engine.load_adapter(name, path, str(version))
        except AdapterError as exc:
            raise EngineError(503, f"engine {self.name} could not load adapter {name} v{version}: {exc}") from None

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (requests under way with it finish with it); one not loaded is no error."""
        with contextlib.suppress(UnknownAdapter):
            await self.engine.unload_adapter(name)

    async def refresh_version(self) -> int:
        return self.weight_version

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)

    async def close(self) -> None:
        pass
