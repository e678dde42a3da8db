"""How the gateway reaches an engine: SGLang's native protocol, whatever the transport.

The gateway only ever builds `/generate` bodies and reads `/generate` responses. The in-process
client hands the body to the same `native.generate` the engine's HTTP server uses.
"""

from __future__ import annotations

from typing import Any, Protocol

from serve.engine import Engine
from serve.engine import generate as native_generate


class EngineClient(Protocol):
    async def generate(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    @property
    def weight_version(self) -> int: ...


class InProcessEngineClient:
    """An embedded `Engine` in this process."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        return await native_generate(self.engine, body)

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self.engine.update_weights(model_path, weight_version)

    @property
    def weight_version(self) -> int:
        return self.engine.version
