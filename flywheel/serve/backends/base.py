"""How the gateway reaches an engine: SGLang's native protocol, whatever the transport.

The gateway only builds `/generate` bodies and reads `/generate` responses and chunks, and
drives weight swaps with `/pause_generation`, `/update_weights_from_disk` and
`/continue_generation`, and LoRA adapters with `/load_lora_adapter` and `/unload_lora_adapter`.
`HTTPEngineClient` does that over HTTP (a real SGLang server, or `flywheel engine`);
`InProcessEngineClient` hands the same bodies to the same `flywheel.serve.engine.native`
functions the engine's HTTP server uses, without the socket. Streams come out of both as
deltas: the HTTP client turns SGLang's default cumulative chunks into deltas.

An engine's `weight_version` here is Flywheel's integer version (`flywheel.serve.engine_choice.version_of` of
the engine's label). The in-process client reads the embedded engine's exact per-token versions;
the HTTP client, which may be talking to a server that reports one label per response or chunk,
bounds each chunk's versions by what it knew of the engine (`flywheel.serve.engine_choice.bound_versions`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol


class EngineError(Exception):
    """An engine refused a request (`status` 400), failed it (500; the requests batched with it
    went on) or could not be reached (503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineClient(Protocol):
    name: str
    weight_version: int

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    async def load_adapter(self, name: str, path: str, version: int) -> None:
        """Load version `version` of LoRA adapter `name` from the PEFT directory `path` (a body's
        `lora_path` names it); the adapter's tokens then report that version."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (SGLang's `/unload_lora_adapter`): a request naming it is
        refused from then on; one not loaded is no error (unloading is how a forgotten user's
        adapter leaves every engine)."""
        ...

    async def refresh_version(self) -> int:
        """Ask the engine which weights it has (another gateway may have swapped them)."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def close(self) -> None: ...
