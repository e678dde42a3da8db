"""The gateway under hostile and operational conditions through real HTTP: fuzzed bodies never
produce a 5xx, keys are enforced, bodies and concurrency are bounded, metrics are exposed, and a
real agent framework (LangChain's ChatOpenAI) works unmodified."""

import asyncio
import json
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import EmbeddedNats
from config import load_config
from serve.loop import ServeLoop

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
KEYS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
        "stream", "logprobs", "top_logprobs", "tools", "tool_choice", "user", "metadata", "prompt", "echo", "extra"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bad"]),
                                 "content": st.one_of(st.text(max_size=40), st.none(), json_values)})
bodies = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6),
    st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(message, max_size=3)},
                          optional={"max_tokens": st.integers(-5, 5000), "n": st.integers(-1, 40),
                                    "temperature": st.floats(-1, 3), "stop": json_values, "stream": st.booleans(),
                                    "logprobs": json_values, "top_logprobs": st.integers(-2, 30), "tools": json_values}),
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """One gateway for the module, run on its own event loop in a thread."""
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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzzed_bodies_never_get_a_5xx(gateway, body, path):
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        response = http.post(path, content=json.dumps(body))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_fuzzed_bytes_never_get_a_5xx(gateway, raw):
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()


def test_large_bodies_are_refused_and_metrics_count_requests(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30000}]}
        response = http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
        ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        text = http.get("/metrics").text
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="413"}' in text
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "flywheel_time_to_first_token_seconds_count" in text and "flywheel_weight_version 0.0" in text


def test_langchain_chat_openai_works_unmodified(gateway):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="x", model="tiny", max_tokens=5, max_retries=0)
    reply = chat.invoke("Write some digits.")
    assert isinstance(reply.content, str) and reply.response_metadata["system_fingerprint"] == "flywheel-v0"
    streamed = "".join(chunk.content for chunk in chat.stream("hello"))
    assert isinstance(streamed, str)


async def test_keys_and_overload(nats_url, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.api_keys=[k1]", "serve.admin_key=adm",
                                "serve.max_concurrent_requests=1", "serve.max_queued_requests=0", "serve.retry_after_s=2"])
    serve = ServeLoop(config, nats_url)
    await serve.start()
    try:
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        async with httpx.AsyncClient(base_url=serve.url) as http:
            assert (await http.get("/health")).status_code == 200  # open
        # One slot, no queue: while a long stream holds the slot, the next request is refused.
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=200, stream=True, temperature=0)
        first = await anext(aiter(stream))
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "2"
        await stream.close()
        for _ in range(100):
            if serve.app.state.limiter.active == 0:
                break
            await asyncio.sleep(0.02)
        ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        await serve.stop()
