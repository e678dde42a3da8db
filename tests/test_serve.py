"""The serve loop over real HTTP with the official openai client: completions, recorded turns
with exact tokens, session signals, OpenAI-shaped errors, and hot swaps from the bus."""

import asyncio
import gc
import threading

import httpx
import openai
import pytest

from flywheel.bus import (
    WEIGHTS_SUBJECT,
    SessionEvent,
    Turn,
    WeightUpdate,
)
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model
from flywheel.serve.loop import ServeLoop

from bus_reading import session_events, traffic_records
from factories import open_session
from waiting import until


async def test_a_server_starting_forces_no_collection_of_the_whole_process(nats_url, tmp_path, monkeypatch):
    """Starting freezes what is alive (out of the collector's reach while it serves) without forcing
    a full collection first: one found 276 unreachable objects, freed no memory and cost 0.26 s;
    where many servers start in one process (the tests' workers), each walked all of it."""
    forced = []
    monkeypatch.setattr(gc, "collect", lambda *args: forced.append(args) or 0)
    loop = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0"]), nats_url)
    await loop.start()
    try:
        assert forced == [] and gc.get_freeze_count() > 0
    finally:
        await loop.stop()
    assert gc.get_freeze_count() == 0  # what it froze may be collected again


async def test_a_port_in_use_is_a_config_error_and_the_process_goes_on(nats_url, tmp_path):
    """uvicorn exits (SystemExit) when it cannot listen: the server says which setting, stops what
    it started, and the event loop it ran in goes on (the SystemExit had stopped the tests' loop:
    every later test of that worker failed)."""
    from flywheel.config import ConfigError

    taken = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = taken.sockets[0].getsockname()[1]
    try:
        loop = ServeLoop(load_config(None, [f"run_dir={tmp_path}", f"serve.port={port}"]), nats_url)
        with pytest.raises(ConfigError, match=f"serve.port.*{port}"):
            await loop.start()
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
                and t.get_name() in ("recorder", "http", "tenants", "forget")] == []
        await asyncio.sleep(0)  # the loop still runs
    finally:
        taken.close()


async def test_chat_completion_is_recorded_with_exact_tokens(served, client, bus):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write some digits."}]
    reply = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0.8, seed=7,
        extra_headers={"X-Session-Id": "sess-1", "X-Task-Id": "task-9"},
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.system_fingerprint == "flywheel-v0" and reply.model == "tiny"
    [turn] = await traffic_records(bus, 1)
    assert isinstance(turn, Turn)
    tokenizer = served.engine.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert turn.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.decode(turn.output_ids, skip_special_tokens=True) == choice.message.content
    assert len(turn.output_ids) == len(turn.output_logprobs) == len(turn.output_versions) == reply.usage.completion_tokens
    assert reply.usage.prompt_tokens == len(turn.prompt_ids)
    assert turn.session_id == "sess-1" and turn.task_id == "task-9" and turn.turn_type == "main"
    assert turn.turn_index == 0 and not turn.session_done
    assert turn.sampling["temperature"] == 0.8 and turn.sampling["sampling_seed"] == 7
    assert turn.response == {"role": "assistant", "content": choice.message.content}


async def test_without_the_header_the_session_id_comes_from_metadata_or_user(served, client, bus):
    base = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    await client.chat.completions.create(**base, metadata={"session_id": "from-metadata"})
    await client.chat.completions.create(**base, user="from-user")
    turns = await traffic_records(bus, 2)
    assert [t.session_id for t in turns] == ["from-metadata", "from-user"]
    assert not turns[0].session_done and not turns[1].session_done


async def test_a_request_naming_no_session_is_a_session_of_one_turn(served, client, bus):
    await client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    [turn] = await traffic_records(bus, 1)
    assert turn.session_id.startswith("anon-") and turn.session_done


async def test_headers_mark_a_side_turn_and_the_end_of_a_session(served, client, bus):
    await client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"X-Session-Id": "s", "X-Turn-Type": "side", "X-Session-Done": "true"})
    [turn] = await traffic_records(bus, 1)
    assert turn.session_id == "s" and turn.turn_type == "side" and turn.session_done


async def test_feedback_becomes_a_session_event(served, bus):
    await open_session(served.url, "s1")
    async with httpx.AsyncClient(base_url=served.url) as http:
        ok = await http.post("/v1/sessions/s1/feedback", json={"reward": 0.5, "turn_index": 2, "text": "good", "source": "env"})
        assert ok.status_code == 200 and ok.json()["kind"] == "feedback"
    [feedback] = await session_events(bus, 1)
    assert isinstance(feedback, SessionEvent) and feedback.reward == 0.5 and feedback.turn_index == 2
    assert feedback.text == "good" and feedback.source == "env" and feedback.session_id == "s1"


async def test_an_end_becomes_a_session_event(served, bus):
    await open_session(served.url, "s1")
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.post("/v1/sessions/s1/end")).status_code == 200
    [end] = await session_events(bus, 1)
    assert isinstance(end, SessionEvent) and end.kind == "end" and end.session_id == "s1"


async def test_feedback_or_an_end_of_a_session_never_opened_is_a_404_and_is_not_recorded(served, bus):
    async with httpx.AsyncClient(base_url=served.url) as http:
        missing = [await http.post("/v1/sessions/nowhere/feedback", json={"reward": 1.0}),
                   await http.post("/v1/sessions/nowhere/end")]
    assert [(r.status_code, r.json()["error"]["code"]) for r in missing] == [(404, "session_not_found")] * 2
    await open_session(served.url, "s1")
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.post("/v1/sessions/s1/end")).status_code == 200
    [end] = await session_events(bus, 1)  # the first event recorded is the one of the session that exists
    assert end.session_id == "s1"


async def test_unusable_feedback_is_a_400_naming_what_is_wrong_and_is_not_recorded(served, bus):
    await open_session(served.url, "s1")
    async with httpx.AsyncClient(base_url=served.url) as http:
        bad = await http.post("/v1/sessions/s1/feedback", json={})
        assert bad.status_code == 400 and "reward or a text" in bad.json()["error"]["message"]
        bad = await http.post("/v1/sessions/s1/feedback", json={"reward": "lots"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
        # found by the fuzzer: a number the bus cannot carry was a 503 "send it again", forever
        bad = await http.post("/v1/sessions/s1/feedback", json={"reward": 1, "details": {"n": [-(2**63) - 1]}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "details", bad.text
        assert (await http.post("/v1/sessions/s1/end")).status_code == 200
    [end] = await session_events(bus, 1)  # nothing of the refused feedback was recorded
    assert end.kind == "end"


async def test_serve_max_new_tokens_bounds_requests_that_name_no_limit(served, client):
    """The fixture's serve.max_new_tokens (64) is below default_max_new_tokens (256)."""
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Talk."}], seed=3)
    assert reply.usage.completion_tokens <= 64 and reply.choices[0].finish_reason == "length"


async def test_the_model_list_names_the_served_model(served, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_health_reports_the_weight_version_served(served):
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok", "weight_version": 0}


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "needs content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400, "stream=true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, 400, "penalties"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs=true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "requires tools"),
    ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 2}}, 400, "unsupported parameter: logit_bias"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400, "limit"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 70_000}]}, 400, "context window"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
])
async def test_bad_requests_get_openai_errors(served, body, status, fragment):
    async with httpx.AsyncClient(base_url=served.url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"].endswith("error")


async def test_malformed_bodies_and_headers(served):
    async with httpx.AsyncClient(base_url=served.url) as http:
        r = await http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", content=b"\xff\xfe\xfa", headers={"content-type": "application/json"})
        assert r.status_code == 400
        ok = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        r = await http.post("/v1/chat/completions", json=ok, headers={"X-Turn-Type": "sideways"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Turn-Type"
        r = await http.post("/v1/chat/completions", json=ok)
        assert r.status_code == 200


async def test_sync_client_works_too(served):
    def call():
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as sync:
            return sync.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)

    reply = await asyncio.to_thread(call)
    assert reply.usage.completion_tokens <= 3


async def test_announced_weights_are_swapped_in_and_versions_recorded(served, client, bus, tmp_path):
    model, _ = load_model("tiny")
    path = WeightStore(tmp_path / "store").publish(model, 3)
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w3", version=3, path=str(path), step=3))
    await until(lambda: served.engine.version == "3")
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.system_fingerprint == "flywheel-v3"
    [turn] = await traffic_records(bus, 1)
    assert turn.output_versions == [3] * len(turn.output_ids)
    assert served.stats()["swaps"] == 1


async def test_shutdown_lets_in_flight_streams_finish(nats_url, tmp_path, bus):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.shutdown_grace_s=30"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    client = openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=60, temperature=0, stream=True,
                                                  extra_headers={"X-Session-Id": "draining"})
    first = await anext(aiter(stream))
    stopping = asyncio.create_task(loop.stop())
    rest = [chunk async for chunk in stream]
    await stopping
    assert first.choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] in (["stop"], ["length"])
    [turn] = await traffic_records(bus, 1)  # recorded and published before the loop stopped
    assert turn.session_id == "draining" and not turn.client_disconnected


async def test_requests_past_the_timeout_end_with_a_504_or_an_error_event(nats_url, tmp_path, bus):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.request_timeout_s=0.5"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    try:
        await loop.engine.pause("in_place")  # nothing can finish now
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with httpx.AsyncClient(base_url=loop.url, timeout=30) as http:
            whole = await http.post("/v1/chat/completions", json=body)
            streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout"
        events = [line for line in streamed.text.splitlines() if line.startswith("data:")]
        assert streamed.status_code == 200 and '"code": "timeout"' in events[-2] and events[-1] == "data: [DONE]"
        await loop.engine.resume()
        turns = await traffic_records(bus, 2)
        assert [t.finish_reason for t in turns] == ["abort", "abort"]  # recorded, marked unfinished
        assert loop.engine.load()["num_waiting_reqs"] == 0  # and aborted in the engine
    finally:
        await loop.stop()


async def test_a_stopped_gateway_leaves_no_thread_of_its_own_running(nats_url, tmp_path):
    """Every thread a gateway started ends with it: a process that starts and stops gateways
    (a test suite, a deployment restarting its serve loop) does not collect them."""
    before = set(threading.enumerate())
    loop = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0"]), nats_url)
    await loop.start()
    client = openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    await loop.stop()
    shared = ("asyncio_", "tqdm_monitor")  # the event loop's default executor, tqdm's monitor: the process's
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and not t.name.startswith(shared)]
    assert left == []
