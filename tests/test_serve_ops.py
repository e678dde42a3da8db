"""The serve loop's operational pieces over real HTTP: API keys, body and load limits, timeouts,
and Prometheus metrics, on a stand-in app wired the way the gateway wires them."""

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from flywheel.config import load_config
from flywheel.serve.api.errors import APIError, install_error_handlers
from flywheel.serve.ops.auth import install_auth
from flywheel.serve.ops.limits import (
    ConcurrencyLimiter,
    install_body_limit,
    request_timeout,
)
from flywheel.serve.ops.metrics import (
    ServeMetrics,
    install_metrics_route,
    install_request_metrics,
)
from flywheel.serve.ops.tenants import TenantDirectory

from waiting import until


class StandIn(BaseModel):
    hold: bool = False
    """Wait for the test to open the gate while holding a generation slot."""
    timeout_s: float = 30.0
    padding: str = ""
    tenant: str = "open"


class Gateway:
    """A small app wired like the gateway: a generation stand-in behind every operational piece."""

    def __init__(self, api_keys=(), admin_key=None, max_body_bytes=1024, max_concurrent=2, max_queue=1, metrics_key=None):
        self.gate = asyncio.Event()
        self.limiter = ConcurrencyLimiter(max_concurrent, max_queue, retry_after_s=1.5)
        self.metrics = ServeMetrics()
        self.app = app = FastAPI()
        install_error_handlers(app)

        @app.post("/v1/chat/completions")
        async def complete(body: StandIn) -> dict:
            async with request_timeout(body.timeout_s), self.limiter.slot(body.tenant):
                if body.hold:
                    await self.gate.wait()
            self.metrics.tokens(prompt=3, completion=2)
            self.metrics.time_to_first_token(0.004)
            self.metrics.time_per_output_token(0.002)
            message = {"role": "assistant", "content": "42"}
            return {"id": "c", "object": "chat.completion", "created": 0, "model": "tiny",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "me"}]}

        @app.post("/pause_generation")
        async def pause() -> dict:
            return {"paused": True}

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        install_metrics_route(app, self.metrics)
        install_body_limit(app, max_body_bytes)
        install_auth(app, TenantDirectory.from_config(load_config(None, [f"serve.api_keys={json.dumps(list(api_keys))}"])),
                     admin_key, metrics_key)
        install_request_metrics(app, self.metrics)

    @asynccontextmanager
    async def serving(self):
        server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", timeout_graceful_shutdown=5
        ))
        task = asyncio.create_task(server.serve())
        await until(lambda: server.started or task.done())
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            self.gate.set()
            server.should_exit = True
            await task


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


async def test_api_keys_guard_the_api_but_not_health_and_metrics():
    gateway = Gateway(api_keys=["k1", "k2"], admin_key="root")
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as http:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k3", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as refused:
                await wrong.models.list()
        assert refused.value.status_code == 401 and "invalid API key" in refused.value.message
        missing = await http.get("/v1/models")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert error_of(missing)["type"] == "authentication_error" and "missing API key" in error_of(missing)["message"]

        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0) as right:
            assert [m.id for m in (await right.models.list()).data] == ["tiny"]
            reply = await right.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "42"
        admin_is_no_client = await http.get("/v1/models", headers={"Authorization": "Bearer root"})
        assert admin_is_no_client.status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics", headers={"Authorization": "Bearer root"})).status_code == 200


async def test_the_admin_key_guards_control_routes():
    gateway = Gateway(api_keys=["k1", "k2"], admin_key="root")
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/pause_generation")).status_code == 401
        as_client = await http.post("/pause_generation", headers={"Authorization": "Bearer k1"})
        assert as_client.status_code == 401 and "invalid admin key" in error_of(as_client)["message"]
        as_admin = await http.post("/pause_generation", headers={"Authorization": "bearer root"})
        assert as_admin.status_code == 200 and as_admin.json() == {"paused": True}


async def test_metrics_need_the_admin_or_the_metrics_key_where_an_admin_key_is_set():
    """`/metrics` names every tenant and counts its requests: not a client's to read."""
    gateway = Gateway(api_keys=["k1"], admin_key="root", metrics_key="scraper")
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as http:
        def as_(key: str | None) -> dict:
            return {"Authorization": f"Bearer {key}"} if key else {}

        assert [(await http.get("/metrics", headers=as_(key))).status_code for key in (None, "k1", "root", "scraper")] == [
            401, 401, 200, 200]
        assert (await http.post("/pause_generation", headers=as_("scraper"))).status_code == 401  # nothing else
        assert (await http.get("/v1/models", headers=as_("scraper"))).status_code == 401


async def test_without_keys_everything_is_open():
    async with Gateway().serving() as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/v1/models")).status_code == 200
        assert (await http.post("/pause_generation")).status_code == 200


async def test_oversize_bodies_get_413_declared_or_chunked():
    async with Gateway(max_body_bytes=1024).serving() as url, httpx.AsyncClient(base_url=url) as http:
        declared = await http.post("/v1/chat/completions", json={"padding": "x" * 4096})
        assert declared.status_code == 413
        assert error_of(declared)["type"] == "invalid_request_error" and "1024 bytes" in error_of(declared)["message"]

        async def chunks(n: int):
            yield b'{"padding": "'
            for _ in range(n):
                yield b"x" * 256
            yield b'"}'

        chunked = await http.post("/v1/chat/completions", content=chunks(16), headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and error_of(chunked)["code"] == "request_too_large"
        small = await http.post("/v1/chat/completions", content=chunks(2), headers={"content-type": "application/json"})
        assert small.status_code == 200 and small.json()["choices"][0]["message"]["content"] == "42"


async def test_overload_is_a_429_with_retry_after_until_slots_free_up():
    gateway = Gateway(max_concurrent=2, max_queue=1)
    limiter = gateway.limiter
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        held = [asyncio.create_task(http.post("/v1/chat/completions", json={"hold": True})) for _ in range(3)]
        await until(lambda: limiter.active == 2 and limiter.waiting == 1)
        refused = await http.post("/v1/chat/completions", json={})
        assert refused.status_code == 429 and error_of(refused)["code"] == "overloaded"
        assert error_of(refused)["type"] == "rate_limit_error"
        assert refused.headers["retry-after"] == "2" and refused.headers["retry-after-ms"] == "1500"
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert limiter.rejected == 2

        gateway.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200, 200]
        assert (await http.post("/v1/chat/completions", json={})).status_code == 200
        assert limiter.active == 0 and limiter.waiting == 0


async def test_one_tenants_burst_keeps_no_other_tenant_out_of_line_nor_ahead_of_it():
    """Two slots and a line of three: A holds both and fills the line. B, arriving at the full line,
    takes A's newest place (that caller gets the 429), and so does C; a freed slot goes to the waiting
    tenant that holds the fewest, the first to arrive between equals; a tenant whose own line is as
    long as the longest but one is refused itself. First come, first served alone would have
    refused B and C, and served A's three first."""
    limiter = ConcurrencyLimiter(2, 3, retry_after_s=1)
    granted: list[str] = []

    async def waits(tenant: str, name: str) -> None:
        await limiter.acquire(tenant)
        granted.append(name)

    for _ in range(2):
        await limiter.acquire("a")
    a = [asyncio.create_task(waits("a", f"a{k}")) for k in range(3)]
    await until(lambda: limiter.waiting == 3)
    b = asyncio.create_task(waits("b", "b"))
    with pytest.raises(APIError) as refused:
        await a[2]
    assert refused.value.status == 429 and refused.value.code == "overloaded"
    c = asyncio.create_task(waits("c", "c"))
    with pytest.raises(APIError):
        await a[1]
    await until(lambda: limiter.waiting == 3)  # a0, b, c
    with pytest.raises(APIError):  # b's line (1) is as long as the longest (1) but one: no room made
        await limiter.acquire("b")
    assert limiter.rejected == 3 and granted == []

    limiter.release("a")  # a holds 1; b and c none: b came first
    await b
    limiter.release("a")  # a, c: none each; a0 came before c
    await a[0]
    limiter.release("b")
    await c
    assert granted == ["b", "a0", "c"] and limiter.active == 2 and limiter.waiting == 0
    limiter.release("a")
    limiter.release("c")
    assert limiter.active == 0


async def test_a_request_timed_out_in_line_is_a_504_and_gives_back_its_place():
    gateway = Gateway(max_concurrent=1, max_queue=4)
    limiter = gateway.limiter
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        holder = asyncio.create_task(http.post("/v1/chat/completions", json={"hold": True}))
        await until(lambda: limiter.active == 1)
        queued = await http.post("/v1/chat/completions", json={"timeout_s": 0.2})
        assert queued.status_code == 504
        error = error_of(queued)
        assert error["code"] == "timeout" and error["type"] == "server_error" and "0.2 s" in error["message"]
        assert limiter.waiting == 0 and limiter.active == 1
        gateway.gate.set()
        assert (await holder).status_code == 200


async def test_a_request_timed_out_holding_a_slot_is_a_504_and_gives_back_the_slot():
    gateway = Gateway(max_concurrent=1, max_queue=4)
    limiter = gateway.limiter
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        stuck = await http.post("/v1/chat/completions", json={"hold": True, "timeout_s": 0.2})
        assert stuck.status_code == 504 and limiter.active == 0
        assert (await http.post("/v1/chat/completions", json={})).status_code == 200


async def test_a_request_timeout_does_not_fire_once_its_body_has_finished():
    async def quick_then_linger() -> str:
        async with request_timeout(0.05):
            pass
        await asyncio.sleep(0.2)  # a sleep, not a wait: outlives the time limit of a body that has finished
        return "done"

    assert await asyncio.create_task(quick_then_linger()) == "done"


async def test_a_request_timeout_lets_a_cancellation_from_outside_through():
    entered = asyncio.Event()

    async def cancelled_from_outside() -> None:
        async with request_timeout(10):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(cancelled_from_outside())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_expose_requests_tokens_latencies_and_state():
    gateway = Gateway(api_keys=["k"])
    metrics = gateway.metrics
    recorder_totals = {"published": 0, "dropped": 0, "spilled": 0, "pending": 0}
    metrics.on_scrape(lambda m: m.recorder(**recorder_totals))
    metrics.on_scrape(lambda m: m.admission(gateway.limiter.active, gateway.limiter.waiting, gateway.limiter.rejected))
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as http:
        first = await http.get("/metrics")
        assert first.headers["content-type"].startswith("text/plain")
        before = scrape(first.text)
        assert before[("flywheel_prompt_tokens_total", ())] == 0

        key = {"Authorization": "Bearer k"}
        for _ in range(2):
            assert (await http.post("/v1/chat/completions", json={}, headers=key)).status_code == 200
        assert (await http.post("/v1/chat/completions", json={})).status_code == 401
        assert (await http.get("/nowhere")).status_code == 404
        metrics.engine_state(batch_size=3, waiting=1, kv_tokens=512, kv_capacity_tokens=2048)
        metrics.weight_versions({"http://engine-a": 7, "http://engine-b": 8})  # mid rolling swap
        metrics.swap(0.3)
        recorder_totals.update(published=5, spilled=2, pending=1)
        after = scrape((await http.get("/metrics")).text)

    def requests(endpoint: str, status: str, tenant: str = "none") -> float:
        return after[("flywheel_requests_total", (("endpoint", endpoint), ("status", status), ("tenant", tenant)))]

    key_tenant = TenantDirectory.key_tenant("k")  # the key's own tenant, no tenants: section
    assert requests("/v1/chat/completions", "200", key_tenant) == 2 and requests("/v1/chat/completions", "401") == 1
    assert requests("unmatched", "404") == 1 and requests("/metrics", "200") == 1
    assert after[("flywheel_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),))] == 3
    assert after[("flywheel_prompt_tokens_total", ())] == 6 and after[("flywheel_completion_tokens_total", ())] == 4
    assert after[("flywheel_time_to_first_token_seconds_count", ())] == 2
    assert after[("flywheel_time_to_first_token_seconds_bucket", (("le", "0.005"),))] == 2
    assert after[("flywheel_time_per_output_token_seconds_sum", ())] == pytest.approx(0.004)
    assert after[("flywheel_engine_batch_size", ())] == 3 and after[("flywheel_engine_kv_cache_usage_ratio", ())] == 0.25
    assert after[("flywheel_weight_version", ())] == 7 and after[("flywheel_weight_swap_duration_seconds_count", ())] == 1
    assert after[("flywheel_engine_weight_version", (("engine", "http://engine-b"),))] == 8
    assert after[("flywheel_recorder_published_total", ())] == 5 and after[("flywheel_recorder_spilled_total", ())] == 2
    assert after[("flywheel_recorder_pending", ())] == 1 and after[("flywheel_requests_active", ())] == 0
