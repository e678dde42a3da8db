"""Shared fixtures: a private NATS server per test, one Ray session, the tiny model and the engine
tests' PEFT adapters of it, serve loops (one per test in the test's event loop, or one per module
on a thread of its own), an engine behind HTTP, and a `tiny` taught to call a tool. What they are
built from, and every other helper tests share, is in `factories.py` (reading the bus:
`bus_reading.py`; PEFT adapters: `peft_adapters.py`; the engine's adapter tests:
`engine_adapters.py`). How `make test`'s workers share the files: `file_groups.py`.

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


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_path):
    """The tiny model and its tokenizer, loaded once for the module."""
    from flywheel.models import load_model

    return load_model(tiny_path)


@pytest.fixture(scope="module")
def engine_adapters(tmp_path_factory):
    """The engine tests' four PEFT adapters (`engine_adapters.ADAPTERS`): {name: (directory, its PEFT
    model)}, under one root directory, one subdirectory each."""
    from engine_adapters import ADAPTERS
    from peft_adapters import random_adapters

    return random_adapters(tmp_path_factory.mktemp("adapters"), ADAPTERS)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (as `make test` runs) keeps each group of the files that start Ray
    clusters in one worker, one after another (`file_groups.py`); other modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from file_groups import FileGroupScheduling

    return FileGroupScheduling(config, log)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
async def served(nats_url, tmp_path):
    """A serve loop on the tiny model in the test's event loop (serve.max_new_tokens 64)."""
    from flywheel.config import load_config
    from flywheel.serve.loop import ServeLoop

    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.max_new_tokens=64"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    yield loop
    await loop.stop()


@pytest.fixture
def client(served):
    """The official async openai client on `served`."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """One gateway for the module, run on its own event loop in a thread, with its own NATS
    server (serve.max_new_tokens 8, default 4, bodies up to 20000 bytes)."""
    import asyncio
    import threading

    from flywheel.bus import EmbeddedNats
    from flywheel.config import load_config
    from flywheel.serve.loop import ServeLoop

    directory = tmp_path_factory.mktemp("gw")
    loop = asyncio.new_event_loop()
    with EmbeddedNats(directory / "nats") as nats:
        config = load_config(None, [f"run_dir={directory}", "serve.port=0", "serve.max_new_tokens=8",
                                    "serve.default_max_new_tokens=4", "serve.max_body_bytes=20000"])
        serve = ServeLoop(config, nats.url)
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(serve.start(), loop).result(120)
        yield serve
        asyncio.run_coroutine_threadsafe(serve.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


@pytest.fixture
async def engine_url():
    """(url, engine): an embedded engine on the tiny model behind SGLang's HTTP protocol (admin key `adm`)."""
    from flywheel.serve.engine.server import create_engine_app

    from factories import RunningApp, make_engine

    engine = make_engine()
    async with RunningApp(create_engine_app(engine, "tiny", "tiny", admin_key="adm")) as url:
        yield url, engine
    engine.stop()


@pytest.fixture(scope="module")
def tool_model():
    """The tiny model, taught by a few supervised steps to answer ASK_WEATHER with WEATHER_CALL."""
    from factories import ASK_WEATHER, WEATHER, WEATHER_CALL, teach_tiny

    return teach_tiny(ASK_WEATHER, [WEATHER], WEATHER_CALL)


@pytest.fixture
async def served_tools(tool_model, nats_url, tmp_path):
    """(serve loop, async openai client): `tool_model` served as `tool-tiny`."""
    import openai

    from factories import serving

    async with serving(tool_model, "tool-tiny", nats_url, tmp_path) as loop:
        yield loop, openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)
