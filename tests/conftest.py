"""Shared fixtures: a private NATS server per test, one Ray session, the tiny model.

Property-based tests (the fuzzers) draw the same examples on every run (hypothesis's
`derandomize`), so the suite passes or fails the same way each time. To search for new failures,
run them with fresh random examples: `FLYWHEEL_HYPOTHESIS=explore pytest tests/test_fuzz_api.py
tests/test_gateway_robustness.py`; each failure found that way becomes a fixed example in a test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FLYWHEEL_HYPOTHESIS", "repeatable"))

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("FLYWHEEL_CACHE", str(ROOT / ".cache" / "flywheel"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait at a barrier sleep instead of spinning (in this process and every
# server a test starts: set before torch loads). Two test workers and their servers run more
# torch threads than there are cores; spinning threads starved the others: a 6 s fixture took
# 100-160 s while the other worker ran vLLM (docs/benchmarks.md, odd things 7).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under `pytest -n N`
if _worker:  # each worker's sandbox slots get uids of their own (closing a sandbox kills its uid's processes)
    os.environ.setdefault("FLYWHEEL_SANDBOX_UID_BASE", str(10000 * (1 + int(_worker.removeprefix("gw")))))


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once it has stopped. `kill` returns before the signal takes effect:
    under load the process went on for a moment and, in the bus drill, acknowledged a publish it
    was meant never to read (the test then waited for an in-flight publish that had ended)."""
    import signal
    import time

    import psutil

    os.kill(pid, signal.SIGSTOP)
    process, deadline = psutil.Process(pid), time.monotonic() + timeout_s
    while process.status() != psutil.STATUS_STOPPED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout_s}s")
        time.sleep(0.001)


@pytest.fixture
def nats_server(tmp_path):
    """A fresh embedded nats-server with JetStream (a new one per test: no shared state)."""
    from flywheel.bus import EmbeddedNats

    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
async def bus(nats_url):
    from flywheel.bus import Bus

    connection = await Bus.connect(nats_url, name="test")
    yield connection
    await connection.close()


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from flywheel.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class RunningApp:
    """An ASGI app served by uvicorn on a free loopback port, in the test's event loop."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))

    async def __aenter__(self) -> str:
        import asyncio

        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.task
