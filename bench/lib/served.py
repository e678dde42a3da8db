"""Starting a real serve loop for the gateway benchmarks: a private nats-server in a temporary
directory and `flywheel.serve.loop.ServeLoop` on a free loopback port; and running the streaming client
(`bench/lib/stream_client.py`) as a child process."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.common import CpuWatch

CLIENT = Path(__file__).resolve().parent / "stream_client.py"


class Served:
    """`async with Served(model, overrides) as s:` -> s.loop (ServeLoop), s.url, s.nats_url, s.tmp;
    with `native=True` also s.native_url: the same embedded engine behind its SGLang-protocol
    server (`flywheel.serve.engine.server`, incremental streaming) on a second loopback port, in the
    same process and event loop as the gateway."""

    def __init__(self, model: str, overrides: list[str], native: bool = False):
        self.model = model
        self.overrides = overrides
        self.native = native
        self.native_url: str | None = None
        self._native_server = None

    async def __aenter__(self) -> "Served":
        from flywheel.bus import EmbeddedNats
        from flywheel.config import load_config
        from flywheel.serve.loop import ServeLoop

        self._tmp = tempfile.TemporaryDirectory(prefix="flywheel-bench-")
        self.tmp = Path(self._tmp.name)
        self.nats = EmbeddedNats(self.tmp / "nats")
        self.nats_url = self.nats.start()
        config = load_config(None, [f"run_dir={self.tmp / 'run'}", "serve.port=0", f"model={self.model}", *self.overrides])
        self.config = config
        self.loop = ServeLoop(config, self.nats_url)
        self.url = await self.loop.start()
        if self.native:
            self.native_url = await self._serve_native()
        return self

    async def _serve_native(self) -> str:
        import uvicorn

        from flywheel.serve.engine.server import create_engine_app

        app = create_engine_app(self.loop.engine, self.model, self.loop.model_name, incremental_streaming=True)
        self._native_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self._native_task = asyncio.create_task(self._native_server.serve())
        while not self._native_server.started:
            if self._native_task.done():
                self._native_task.result()  # raises the reason it could not start
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{self._native_server.servers[0].sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._native_server is not None:
                self._native_server.should_exit = True
                await self._native_task
            await self.loop.stop()
        finally:
            self.nats.stop()
            self._tmp.cleanup()


class ClientRun:
    """One run of the streaming client process; `await run()` -> its output plus CPU record."""

    counter = 0

    def __init__(self, workdir: Path, cfg: dict[str, Any]):
        ClientRun.counter += 1
        self.cfg_path = workdir / f"client-{ClientRun.counter}.json"
        self.out_path = workdir / f"client-{ClientRun.counter}-out.json"
        self.cfg = dict(cfg, out=str(self.out_path))
        self.cfg_path.write_text(json.dumps(self.cfg))

    async def start(self) -> None:
        """Start the process and wait until it is connected (imports are not timed)."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CLIENT), str(self.cfg_path), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        line = await self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"stream client did not start: {line!r}")

    async def go(self) -> None:
        self.watch = CpuWatch().start()
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def finish(self) -> dict[str, Any]:
        line = await self.proc.stdout.readline()
        cpu = self.watch.stop()
        await self.proc.wait()
        if line.strip() != b"done":
            raise RuntimeError(f"stream client failed (exit {self.proc.returncode})")
        out = json.loads(self.out_path.read_text())
        out["cpu"] = cpu
        return out

    async def run(self) -> dict[str, Any]:
        await self.start()
        await self.go()
        return await self.finish()
