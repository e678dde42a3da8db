"""The embedded engine behind HTTP, speaking SGLang's native protocol, and the gateway reaching
engines only through it: several engines, session-affine routing, rolling weight swaps."""

import asyncio
import json

import httpx
import openai
import pytest
import torch

from flywheel.bus import WEIGHTS_SUBJECT, WeightUpdate
from flywheel.config import ConfigError, load_config
from flywheel.models import WeightStore, load_model
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.engine.server import create_engine_app
from flywheel.serve.loop import ServeLoop

from bus_reading import recorded_turns
from factories import RunningApp, make_engine
from waiting import until


def sse_chunks(text: str) -> list:
    lines = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_generate_json_and_cumulative_stream(engine_url):
    url, engine = engine_url
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    async with httpx.AsyncClient(base_url=url) as http:
        whole = (await http.post("/generate", json=body)).json()
        streamed = sse_chunks((await http.post("/generate", json={**body, "stream": True})).text)
        assert (await http.put("/generate", json=body)).status_code == 200
    assert whole["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert [e[1] for e in whole["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    last = streamed[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]  # cumulative
    assert all(c["meta_info"]["finish_reason"] is None for c in streamed[:-1])
    lengths = [len(c["output_ids"]) for c in streamed]  # a slow reader may get tokens in batches
    assert lengths == sorted(lengths) and lengths[-1] == 6 and 0 not in lengths
    assert all(whole["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in streamed)


async def test_control_routes_speak_sglang(engine_url, tmp_path):
    url, engine = engine_url
    admin = {"Authorization": "Bearer adm"}
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/pause_generation", json={})).status_code == 401
        assert (await http.post("/pause_generation", json={}, headers=admin)).json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert engine.paused
        assert (await http.post("/continue_generation", json={}, headers=admin)).json()["status"] == "ok"
        path = WeightStore(tmp_path).publish(engine.model, 4)
        reply = await http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "4"}, headers=admin)
        assert reply.json()["success"] and "updated to 4" in reply.json()["message"]
        bad = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none")}, headers=admin)
        assert bad.status_code == 400 and bad.json()["success"] is False
        info = (await http.get("/model_info")).json()
        assert info["weight_version"] == "4" and info["model_type"] == "qwen2"
        assert (await http.get("/get_model_info")).json() == info
        flushed = await http.get("/flush_cache", headers=admin)
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
        assert (await http.get("/health")).status_code == 200 and (await http.get("/health")).content == b""
        assert (await http.get("/health_generate")).status_code == 200
        assert (await http.get("/v1/loads")).json()["num_running_reqs"] == 0
        assert (await http.post("/abort_request", json={"abort_all": True}, headers=admin)).status_code == 200
        error = await http.post("/generate", json={"text": "x", "input_ids": [1]})
        assert error.status_code == 400 and "exactly one" in error.json()["error"]
        assert (await http.post("/generate", content=b"{oops")).status_code == 400


async def test_reloading_the_model_path_model_info_reports_works_for_a_model_name(engine_url):
    """SGLang reloads whatever it was launched with, a hub id or a path; an engine started from a
    model name (`--model tiny`) reports `model_path: "tiny"` and must reload it (it answered "no
    .safetensors files in tiny")."""
    url, engine = engine_url
    admin = {"Authorization": "Bearer adm"}
    original = {name: value.clone() for name, value in engine.model.state_dict().items()}
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.add_(1.0)
    async with httpx.AsyncClient(base_url=url) as http:
        info = (await http.get("/model_info")).json()
        assert info["model_path"] == "tiny"
        reply = await http.post("/update_weights_from_disk", json={"model_path": info["model_path"]}, headers=admin)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert all(torch.equal(value, original[name]) for name, value in engine.model.state_dict().items())


async def test_abort_request_returns_partial_output_over_http(engine_url):
    url, engine = engine_url
    body = {"text": "hello", "rid": "slow", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        pending = asyncio.ensure_future(http.post("/generate", json=body))
        await until(lambda: engine.load()["num_running_reqs"] > 0)
        await http.post("/abort_request", json={"rid": "slow"}, headers={"Authorization": "Bearer adm"})
        reply = (await pending).json()
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(reply["output_ids"]) < 500


async def test_http_client_turns_cumulative_streams_into_deltas(engine_url):
    url, _ = engine_url
    client = await HTTPEngineClient(url, admin_key="adm").connect()
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    whole = await client.generate(body)
    deltas = [chunk async for chunk in client.generate_stream(body)]
    assert [t for d in deltas for t in d["output_ids"]] == whole["output_ids"]
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert [e[0] for d in deltas for e in d["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in whole["meta_info"]["output_token_logprobs"]], abs=1e-5)
    await client.close()


def test_routing_is_sticky_and_spreads():
    class Named:
        def __init__(self, name):
            self.name, self.weight_version = name, 0

    pool = EnginePool([Named(f"http://e{i}") for i in range(3)])
    first = {f"s{i}": pool.route(f"s{i}").name for i in range(300)}
    assert first == {f"s{i}": pool.route(f"s{i}").name for i in range(300)}
    assert set(first.values()) == {"http://e0", "http://e1", "http://e2"}
    smaller = EnginePool(pool.engines[:2])  # only e2's sessions move when e2 goes
    assert all(smaller.route(s).name == e for s, e in first.items() if e != "http://e2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
async def test_a_gpu_engine_without_a_gpu_is_a_config_error_naming_the_key(nats_url, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.device=cuda:0"])
    with pytest.raises(ConfigError, match=r"serve.device: device 'cuda:0' is not available here"):
        await ServeLoop(config, nats_url).start()


async def test_gateway_over_two_http_engines_with_a_rolling_swap(nats_url, bus, tmp_path):
    engines = [make_engine(), make_engine()]
    apps = [RunningApp(create_engine_app(e, "tiny", "tiny")) for e in engines]
    urls = [await app.__aenter__() for app in apps]
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", f"serve.engine_urls={json.dumps(urls)}"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)
        for i in range(6):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                 extra_headers={"X-Session-Id": f"s{i}"})
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                                 extra_headers={"X-Session-Id": f"s{i}"})
        served = [e.stats["requests"] for e in engines]
        assert sum(served) == 12 and all(n % 2 == 0 for n in served)  # a session's turns stay on one engine
        model, _ = load_model("tiny")
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        path = WeightStore(tmp_path / "store").publish(model, 2)
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w2", version=2, path=str(path), step=2))
        await until(lambda: loop.stats()["swaps"] >= 1)
        assert [e.version for e in engines] == ["2", "2"] and loop.stats()["swaps"] == 1
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True, extra_headers={"X-Session-Id": "after"})
        chunks = [c async for c in stream]
        assert chunks[-1].system_fingerprint == "flywheel-v2"
        recorded = await recorded_turns(bus, 13)
        assert recorded[-1].session_id == "after" and set(recorded[-1].output_versions) == {2}
        assert all(set(t.output_versions) == {0} for t in recorded[:12])
    finally:
        await loop.stop()
        for app, engine in zip(apps, engines):
            await app.__aexit__()
            engine.stop()


async def test_a_prefill_only_request_scores_the_tokens_it_is_given_as_sglang_does(engine_url):
    """SGLang's prefill-only scoring (`max_new_tokens: 0`, `return_logprob`, `logprob_start_len`):
    `input_token_logprobs` from that position, [logprob, id, null], the first null, nothing
    generated. A teacher scores what a policy sampled this way (hint distillation), so the scores
    of a continuation must equal the log-probabilities the engine recorded when it sampled it."""
    url, _ = engine_url
    prompt = [5, 9, 13, 21, 34]
    sampling = {"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 3}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        sampled = (await http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                      "return_logprob": True})).json()
        ids = prompt + sampled["output_ids"]
        start = len(prompt) - 1
        scored = (await http.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0.8},
            "return_logprob": True, "logprob_start_len": start})).json()
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = scored["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids) - start and [e[1] for e in entries] == ids[start:] and all(e[2] is None for e in entries)
    assert entries[0][0] is None
    recorded = [e[0] for e in sampled["meta_info"]["output_token_logprobs"]]
    assert [e[0] for e in entries[1:]] == pytest.approx(recorded, abs=1e-4)


async def test_a_prefill_only_request_returns_each_positions_top_logprobs_as_sglang_does(engine_url):
    """With `top_logprobs_num` k, SGLang's `input_top_logprobs` comes beside `input_token_logprobs`,
    aligned with it: entry 0 None, then per position k [logprob, id, null] entries, likeliest
    first (a teacher's whole distribution for dense hint distillation). They are the top of the
    distribution the output's tokens were sampled from: at each position, the generation's own
    `output_top_logprobs`."""
    url, _ = engine_url
    prompt, k = [5, 9, 13, 21, 34], 5
    sampling = {"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 4}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        sampled = (await http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                      "return_logprob": True, "top_logprobs_num": k})).json()
        ids = prompt + sampled["output_ids"]
        start = len(prompt) - 1
        scored = (await http.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0.8},
            "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": k})).json()
        plain = (await http.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0.8},
            "return_logprob": True, "logprob_start_len": start})).json()
    tops = scored["meta_info"]["input_top_logprobs"]
    assert len(tops) == len(scored["meta_info"]["input_token_logprobs"]) == len(ids) - start and tops[0] is None
    for position, (top, generated) in enumerate(zip(tops[1:], sampled["meta_info"]["output_top_logprobs"])):
        assert len(top) == k and all(e[2] is None for e in top)
        values = [e[0] for e in top]
        assert values == sorted(values, reverse=True)
        assert [e[1] for e in top] == [e[1] for e in generated], position
        assert values == pytest.approx([e[0] for e in generated], abs=1e-4)
        token_logprob = scored["meta_info"]["input_token_logprobs"][position + 1][0]
        assert token_logprob <= values[0] + 1e-6 and (token_logprob < values[-1] + 1e-6 or ids[start + 1 + position] in [e[1] for e in top])
    assert "input_top_logprobs" not in plain["meta_info"]
