"""The gateway under hostile and operational conditions through real HTTP: fuzzed bodies (lone
surrogates, huge integers, deep nesting included) never produce a 5xx, invalid strings and seeds
are 400s naming their field, keys are enforced, bodies and concurrency are bounded, metrics are
exposed, and a real agent framework (LangChain's ChatOpenAI) works unmodified."""

import asyncio
import contextlib
import functools
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.config import load_config
from flywheel.serve.loop import ServeLoop

from factories import assert_api_error, assert_openai_error
from waiting import until

CHAT, COMPLETIONS, FEEDBACK = "/v1/chat/completions", "/v1/completions", "/v1/sessions/s1/feedback"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
SURROGATE = "\ud800"
huge_ints = st.sampled_from([2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70)])
texts = st.text(max_size=20)
strings = st.one_of(texts, texts, texts, texts, texts, st.lists(  # lone surrogates, alone or inside text
    st.text(max_size=6) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
    min_size=1, max_size=3).map("".join))
nested = st.tuples(st.integers(30, 500), st.booleans()).map(
    lambda spec: functools.reduce(lambda inner, _: [inner] if spec[1] else {"k": inner}, range(spec[0]), 0))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | huge_ints | st.floats(allow_nan=False) | strings | nested,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(strings, children, max_size=4),
    max_leaves=12,
)
KEYS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
        "stream", "logprobs", "top_logprobs", "tools", "tool_choice", "user", "metadata", "prompt", "echo", "extra"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bad"]),
                                 "content": st.one_of(strings, st.none(), json_values)},
                                optional={"name": json_values, "tool_call_id": strings, "tool_calls": json_values,
                                          "refusal": json_values})
plain_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": strings},
                                      optional={"refusal": json_values, "annotations": json_values})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"])}, optional={"description": strings, "parameters": json_values})})
random_bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)
BODIES = {
    CHAT: st.one_of(
        random_bodies,
        st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(message, max_size=3)},
                              optional={"max_tokens": st.integers(-5, 5000), "n": st.integers(-1, 40),
                                        "temperature": st.floats(-1, 3), "stop": json_values, "stream": st.booleans(),
                                        "logprobs": json_values, "top_logprobs": st.integers(-2, 30),
                                        "tools": json_values}),
        st.fixed_dictionaries(  # mostly valid, so that hostile details reach generation and recording
            {"model": st.just("tiny"), "messages": st.lists(plain_message, min_size=1, max_size=3)},
            optional={"max_tokens": st.integers(1, 8), "n": st.integers(1, 3), "temperature": st.floats(0, 2),
                      "seed": st.integers() | huge_ints, "stop": st.lists(strings, max_size=2), "stream": st.booleans(),
                      "logprobs": st.booleans(), "user": strings, "metadata": st.dictionaries(texts, strings, max_size=2),
                      "tools": st.lists(tool, max_size=2)}),
    ),
    COMPLETIONS: st.one_of(
        random_bodies,
        st.fixed_dictionaries({"model": st.just("tiny"), "prompt": strings | st.lists(st.integers() | huge_ints, max_size=3)},
                              optional={"max_tokens": st.integers(-5, 8), "seed": st.integers() | huge_ints,
                                        "stop": st.lists(strings, max_size=2), "stream": st.booleans()}),
    ),
    RESPONSES: st.one_of(
        random_bodies,
        st.fixed_dictionaries({"model": st.just("tiny"), "input": strings | st.lists(st.one_of(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "system", "bad"]),
                                   "content": strings | json_values}),
            st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
                                  optional={"call_id": strings, "name": strings, "arguments": strings, "role": strings,
                                            "output": strings | json_values, "content": json_values})), max_size=3)},
            optional={"max_output_tokens": st.integers(-5, 5000), "temperature": st.floats(-1, 3), "stream": st.booleans(),
                      "instructions": strings, "tools": st.lists(json_values | st.fixed_dictionaries(
                          {"type": st.sampled_from(["function", "custom", "namespace", "file_search"]), "name": strings},
                          optional={"parameters": json_values}), max_size=2),
                      "tool_choice": json_values, "previous_response_id": strings, "store": st.booleans(),
                      "text": json_values, "metadata": json_values}),
    ),
    MESSAGES: st.one_of(
        random_bodies,
        st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(-5, 64000), "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bad"]), "content": strings | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "x"])},
                                      optional={"text": strings, "id": strings, "name": strings, "input": json_values,
                                                "tool_use_id": strings, "content": strings | json_values}), max_size=3)}),
            max_size=3)},
            optional={"system": strings | json_values, "stream": st.booleans(), "stop_sequences": json_values,
                      "tools": st.lists(json_values, max_size=2), "tool_choice": json_values, "metadata": json_values,
                      "thinking": json_values, "temperature": st.floats(-1, 3)}),
    ),
    FEEDBACK: st.one_of(
        st.dictionaries(st.sampled_from(["reward", "turn_index", "text", "source", "extra"]), json_values, max_size=4),
        st.fixed_dictionaries({}, optional={"reward": st.floats() | st.integers() | huge_ints,
                                            "turn_index": st.integers() | huge_ints, "text": strings, "source": strings}),
    ),
}


def post(gateway, path: str, body) -> httpx.Response:
    """`body` as JSON (lone surrogates as `\\ud800` escapes), on a fresh connection."""
    return httpx.post(gateway.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from(list(BODIES)), data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(gateway, path, data):
    response = post(gateway, path, data.draw(BODIES[path], label="body"))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_api_error(response, path)


def test_a_missing_body_or_one_sent_without_a_json_content_type_is_a_clear_400(gateway):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for response in (httpx.post(gateway.url + CHAT, content=body, timeout=60), httpx.post(gateway.url + CHAT, timeout=60)):
        assert response.status_code == 400 and "JSON object" in assert_openai_error(response)["message"]


ASK = [{"role": "user", "content": "hi"}]
INVALID = [  # (path, body, the param the 400 names)
    (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}]},
     "messages.0.content.0.text"),
    (CHAT, {"messages": ASK, "stop": ["ok", SURROGATE]}, "stop.1"),
    (CHAT, {"messages": ASK, "metadata": {"session_id": SURROGATE}}, "metadata.session_id"),
    (CHAT, {"messages": ASK, "metadata": {SURROGATE: "x"}}, "metadata"),
    (CHAT, {"messages": ASK, "user": SURROGATE}, "user"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "description": SURROGATE}}]},
     "tools.0.function.description"),
    (CHAT, {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"description": SURROGATE}}}}}]},
     "tools.0.function.parameters.properties.city.description"),
    (CHAT, {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": SURROGATE}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    (CHAT, {"messages": ASK + [{"role": "assistant", "content": "x", "refusal": SURROGATE}]}, "messages.1.refusal"),
    (COMPLETIONS, {"prompt": SURROGATE}, "prompt"),
    (FEEDBACK, {"text": SURROGATE}, "text"),
    (FEEDBACK, {"reward": 1.0, "source": SURROGATE}, "source"),
    (FEEDBACK, {"reward": 1.0, "turn_index": 2**70}, "turn_index"),
    (CHAT, {"messages": ASK, "seed": 2**70}, "seed"),
    (CHAT, {"messages": ASK, "seed": -(2**70)}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed"),
]


@pytest.mark.parametrize("path, body, param", INVALID, ids=[param for _, _, param in INVALID])
def test_invalid_strings_and_integers_are_400s_naming_the_field(gateway, path, body, param):
    if path != FEEDBACK:
        body = {"model": "tiny", "max_tokens": 2, **body}
    response = post(gateway, path, body)
    assert response.status_code == 400, response.text
    error = assert_openai_error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    # Nothing the rejected request carried reached the recorder: the next requests are served.
    assert post(gateway, CHAT, {"model": "tiny", "messages": ASK, "max_tokens": 2, "metadata": {"session_id": "s1"}}
                ).status_code == 200
    assert post(gateway, FEEDBACK, {"reward": 1.0, "turn_index": 3}).status_code == 200


def test_seeds_at_the_ends_of_the_64_bit_range_are_served(gateway):
    for seed in (2**63 - 1, -(2**63)):  # choice i samples with seed + i, wrapped into the range
        response = post(gateway, CHAT, {"model": "tiny", "messages": ASK, "max_tokens": 2, "seed": seed, "n": 3})
        assert response.status_code == 200, response.text
        assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]


def test_a_temperature_too_small_to_divide_by_samples_greedily(gateway):
    answers = [post(gateway, COMPLETIONS, {"model": "tiny", "prompt": "12 + 7 =", "max_tokens": 4, "temperature": t})
               for t in (1e-45, 0.0)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


@pytest.mark.parametrize("depth", [400, 5000])
def test_deeply_nested_values_are_not_a_5xx(gateway, depth):
    parameters = "[" * depth + "]" * depth  # written out: too deep for json.dumps
    raw = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [' \
          '{"type": "function", "function": {"name": "f", "parameters": {"p": ' + parameters + "}}}]}"
    response = httpx.post(gateway.url + CHAT, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_openai_error(response)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_fuzzed_bytes_never_get_a_5xx(gateway, raw):
    response = httpx.post(gateway.url + CHAT, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400
    assert_openai_error(response)


def test_a_body_over_the_limit_is_refused_with_a_413(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30000}]}
        response = http.post("/v1/chat/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
        ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200


def test_metrics_count_requests_by_endpoint_and_status(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 30000}]}).status_code == 413
        assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        text = http.get("/metrics").text
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="413",tenant="open"}' in text
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="200",tenant="open"}' in text
    assert "flywheel_time_to_first_token_seconds_count" in text and "flywheel_weight_version 0.0" in text


def test_langchain_chat_openai_works_unmodified(gateway):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="x", model="tiny", max_tokens=5, max_retries=0)
    reply = chat.invoke("Write some digits.")
    assert isinstance(reply.content, str) and reply.response_metadata["system_fingerprint"] == "flywheel-v0"
    streamed = "".join(chunk.content for chunk in chat.stream("hello"))
    assert isinstance(streamed, str)


@contextlib.asynccontextmanager
async def limited(nats_url, tmp_path, *overrides: str):
    """A gateway of its own (in the test's event loop) with `overrides`."""
    serve = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0", *overrides]), nats_url)
    await serve.start()
    try:
        yield serve
    finally:
        await serve.stop()


async def test_api_keys_guard_the_api_but_not_health(nats_url, tmp_path):
    async with limited(nats_url, tmp_path, "serve.api_keys=[k1]", "serve.admin_key=adm") as serve:
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        async with httpx.AsyncClient(base_url=serve.url) as http:
            assert (await http.get("/health")).status_code == 200  # open


async def test_a_request_past_the_concurrency_limit_is_refused_with_retry_after_until_a_slot_is_free(nats_url, tmp_path):
    async with limited(nats_url, tmp_path, "serve.max_concurrent_requests=1", "serve.max_queued_requests=0",
                       "serve.retry_after_s=2") as serve:
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0)
        # One slot, no queue: while a long stream holds the slot, the next request is refused.
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=200, stream=True, temperature=0)
        first = await anext(aiter(stream))
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "2"
        await stream.close()
        await until(lambda: serve.app.state.limiter.active == 0)  # the closed stream gives its slot back
        ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")


async def test_one_tenants_burst_does_not_keep_another_tenant_out(nats_url, tmp_path):
    """One slot and a line of two: tenant A's stream holds the slot and two more of A's requests
    wait. B's request takes the newest of A's places (that one is refused, 429) and is answered
    once A's stream and A's older waiting request have had the slot; first come, first served
    refused B."""
    async with limited(nats_url, tmp_path, "serve.api_keys=[key-a, key-b]", "serve.max_concurrent_requests=1",
                       "serve.max_queued_requests=2") as serve:
        limiter = serve.app.state.limiter
        a, b = (openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key=key, max_retries=0) for key in ("key-a", "key-b"))
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        stream = await a.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=200, stream=True, temperature=0)
        await anext(aiter(stream))
        waiting = [asyncio.create_task(a.chat.completions.create(**ask)) for _ in range(2)]
        await until(lambda: limiter.waiting == 2)
        bs = asyncio.create_task(b.chat.completions.create(**ask))
        await until(lambda: any(t.done() for t in (*waiting, bs)))
        assert not bs.done(), bs.exception()  # waiting in line, not refused
        [refused] = [t for t in waiting if t.done()]
        assert isinstance(refused.exception(), openai.RateLimitError) and limiter.waiting == 2
        await stream.close()
        assert (await bs).choices[0].finish_reason in ("stop", "length")
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        assert [isinstance(answer, openai.RateLimitError) for answer in answers].count(True) == 1
        await until(lambda: limiter.active == 0)
