"""Weight versions as SGLang has them, on the real tiny model over real HTTP: the engine keeps an
opaque string label ("default", "heldout-7", "12"); the gateway turns labels into Flywheel's
integer versions (a non-negative decimal integer is that version, anything else 0); and against
an engine that reports one version per response (like SGLang without per-token spans) the
gateway never labels a token with a version newer than the one that sampled it."""

import asyncio
import json
import subprocess

import httpx
import openai
import pytest
import torch

from flywheel.bus import WEIGHTS_SUBJECT, Turn, WeightUpdate
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model, load_weights
from flywheel.serve import engine_choice as choices
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.engine import Engine
from flywheel.serve.engine.server import create_engine_app
from flywheel.serve.loop import ServeLoop

from bus_reading import recorded_turns
from factories import RunningApp, recomputed_logprobs
from waiting import until

TOL = 5e-4  # a decode step's logprob against a full forward pass of the same weights


def test_labels_become_flywheel_versions():
    assert [choices.version_of(label) for label in ("0", "7", "012", "2147483647")] == [0, 7, 12, 2**31 - 1]
    # Not a Flywheel label: the weights the engine started with, the oldest possible.
    assert [choices.version_of(label) for label in ("default", "heldout-7", "-3", "", "1.5", " 4", "٣", "2147483648", None)] == [0] * 9
    choice = choices.Choice(0, "r")
    choice.add({"text": "ab", "output_ids": [5, 6], "meta_info": {"weight_version": "heldout-7", "finish_reason": None}})
    choice.add({"text": "c", "output_ids": [7], "meta_info": {
        "weight_version": "12", "weight_versions": [{"version": "12", "start": 0, "end": 1}], "finish_reason": None}})
    assert choice.versions == [0, 0, 12] and choice.version == 12


async def test_engine_keeps_any_string_as_its_version_label(tmp_path):
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer, version="default", load_weights=load_weights).start()
    path = str(WeightStore(tmp_path).publish(model, 1))
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    try:
        async with RunningApp(create_engine_app(engine, "tiny", "tiny")) as url, httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/model_info")).json()["weight_version"] == "default"
            assert (await http.post("/generate", json=body)).json()["meta_info"]["weight_version"] == "default"
            client = await HTTPEngineClient(url).connect()
            assert client.weight_version == 0
            reply = (await http.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "heldout-7"})).json()
            assert reply["success"] and "updated to heldout-7" in reply["message"]
            assert (await http.post("/generate", json=body)).json()["meta_info"]["weight_version"] == "heldout-7"
            # Like SGLang, an update that names no version keeps the label.
            assert (await http.post("/update_weights_from_disk", json={"model_path": path})).json()["success"]
            assert (await http.get("/model_info")).json()["weight_version"] == "heldout-7"
            assert (await client.connect()).weight_version == 0
            reply = (await http.post("/update_weight_version", json={"new_version": 12})).json()
            assert reply == {"success": True, "message": "Weight version updated to 12", "new_version": "12"}
            assert (await client.connect()).weight_version == 12
            bad = await http.post("/update_weight_version", json={"new_version": ["x"]})
            assert bad.status_code == 400 and bad.json()["success"] is False
            await client.close()
    finally:
        engine.stop()


@pytest.fixture
def versions(tmp_path):
    """The tiny model's weights (version 0, the engine's starting point) and a clearly different
    set published as version 1."""
    old, _ = load_model("tiny")
    new, _ = load_model("tiny")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return old, new, str(WeightStore(tmp_path / "store").publish(new, 1))


def swap_window(turn: Turn, old, new) -> tuple[int, int]:
    """Where the swap fell in a turn's tokens, from the logprobs alone (in `retract` mode every
    token's logprob is its sampling weights' full forward pass): every token before the first
    index was sampled by version 0, every token from the second on by version 1."""
    lp = list(turn.output_logprobs)
    by_old = [abs(a - b) < TOL for a, b in zip(lp, recomputed_logprobs(old, list(turn.prompt_ids), list(turn.output_ids)))]
    by_new = [abs(a - b) < TOL for a, b in zip(lp, recomputed_logprobs(new, list(turn.prompt_ids), list(turn.output_ids)))]
    lead_old = next((i for i, ok in enumerate(by_old) if not ok), len(lp))
    tail_new = next((i for i, ok in enumerate(reversed(by_new)) if not ok), len(lp))
    first, last = len(lp) - tail_new, lead_old
    assert first <= last, "the logprobs fit neither version"
    return first, last


@pytest.mark.parametrize("spans", [False, True], ids=["one-version-per-chunk", "spans"])
async def test_tokens_in_flight_across_a_swap_are_never_labelled_newer(nats_url, bus, tmp_path, versions, spans):
    """Without spans (SGLang's `weight_version` is the label when the response or chunk is
    produced) the gateway labels a chunk's tokens with the older of the version it knew when
    they began and the one the chunk reports; with spans it uses them, exactly."""
    old, new, path = versions
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer, version="default", load_weights=load_weights).start()
    app = RunningApp(create_engine_app(engine, "tiny", "tiny", incremental_streaming=spans, version_spans=spans))
    url = await app.__aenter__()
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.swap_mode=retract",
                                f"serve.engine_urls={json.dumps([url])}"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0, timeout=120)
        ask = dict(model="tiny", max_tokens=400, temperature=0, extra_body={"ignore_eos": True})

        async def streamed() -> None:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": "Count."}], stream=True,
                                                          extra_headers={"X-Session-Id": "stream"}, **ask)
            assert [c.choices[0].finish_reason async for c in stream if c.choices][-1] == "length"

        whole = asyncio.ensure_future(client.chat.completions.create(
            messages=[{"role": "user", "content": "Write digits."}], extra_headers={"X-Session-Id": "whole"}, **ask))
        stream = asyncio.ensure_future(streamed())
        await until(lambda: engine.stats["tokens"] >= 20 and engine.load()["num_running_reqs"] >= 2, poll_s=0.001)
        await engine.pause("retract")  # both stand still mid-generation; the pool's swap resumes them
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w1", version=1, path=path, step=1))
        assert (await whole).choices[0].finish_reason == "length"
        await stream
        assert engine.version == "1" and loop.pool.weight_version == 1
        turns = {turn.session_id: turn for turn in await recorded_turns(bus, 2)}
    finally:
        await loop.stop()
        await app.__aexit__()
        engine.stop()
    for session, turn in turns.items():
        recorded = list(turn.output_versions)
        first_new, last_old = swap_window(turn, old, new)
        assert 0 < first_new and last_old < len(recorded), "the swap fell inside the generation"
        assert recorded == sorted(recorded) and set(recorded) <= {0, 1}
        assert recorded[:first_new] == [0] * first_new, session  # never newer than what sampled it
        if spans:  # exact
            assert recorded[last_old:] == [1] * (len(recorded) - last_old), session
        elif session == "whole":  # one version for the whole answer: the one the request started on
            assert recorded == [0] * len(recorded)
        else:  # a chunk lags at most the chunk before it
            assert recorded[-1] == 1


async def test_engine_started_with_default_label_serves_version_0(nats_url, bus, tmp_path):
    """`flywheel engine --weight-version default --no-version-spans`, like an SGLang server
    started without --weight-version, behind the gateway."""
    engine = subprocess.Popen([*command("engine"), "--model", "tiny", "--port", "0",
                               "--weight-version", "default", "--no-version-spans"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = await asyncio.to_thread(started_at, engine)
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/model_info")).json()["weight_version"] == "default"
            assert (await http.get("/server_info")).json()["weight_version_spans"] is False
        config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", f"serve.engine_urls={json.dumps([url])}"])
        loop = ServeLoop(config, nats_url)
        await loop.start()
        try:
            client = openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)
            reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            chunks = [c async for c in await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)]
            turns = await recorded_turns(bus, 2)
        finally:
            await loop.stop()
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    assert reply.system_fingerprint == "flywheel-v0" and chunks[-1].system_fingerprint == "flywheel-v0"
    assert all(len(t.output_ids) > 0 and list(t.output_versions) == [0] * len(t.output_ids) for t in turns)


def started_at(engine: subprocess.Popen) -> str:
    for line in engine.stdout:
        if line.startswith("engine serving"):
            return line.split()[-1]
    raise AssertionError("the engine did not start")
