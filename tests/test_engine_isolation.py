"""Numerically safe sampling and per-request failure isolation, on the real tiny model: any top_p
in (0, 1] samples, any integer seed works, and a request whose own sampling fails (probabilities
that are not finite, an exception in its bans or finish checks) fails alone, with an error its
caller receives, while the requests batched with it go on and finish normally. Checked on the
engine, on its SGLang HTTP server, and through the gateway's engine clients."""

import asyncio
import json

import httpx
import pytest

from flywheel.models import load_model
from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.in_process import InProcessEngineClient
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.serve.engine.server import create_engine_app

from factories import RunningApp, prompt
from waiting import until

GOOD = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
TINY_P = {"max_new_tokens": 24, "top_p": 1e-300, "sampling_seed": 1, "ignore_eos": True}
"""Valid per OpenAI and SGLang; underflows to 0 in float32, where it used to make every row NaN."""
NAN = {"max_new_tokens": 24, "temperature": 1e-45, "ignore_eos": True}
"""Logits / 1e-45 overflow float32: this row's probabilities are not finite."""
BAD_BAN = {"max_new_tokens": 24, "min_new_tokens": 3, "stop_token_ids": [10**9]}
"""Banning this stop token before min_new_tokens raises (no such logit)."""
WAIT_S = 30  # far beyond what these requests take: reaching it means something hung


@pytest.fixture(scope="module")
def engine(tiny_path):
    model, tokenizer = load_model(tiny_path)
    eng = Engine(model, tokenizer, max_batch_size=8).start()
    yield eng
    eng.stop()


async def collect(stream) -> list:
    return [item async for item in stream]


async def test_a_bad_request_fails_alone_in_the_batch_it_was_sampled_with(engine):
    ids = prompt(engine.tokenizer, "Write some digits.")
    alone = await engine.generate(ids, GOOD)
    await engine.pause("in_place")  # all of the below are admitted together: one prefill, one sampling call
    try:
        work = [
            engine.generate(ids, GOOD), engine.generate(ids, GOOD), collect(engine.stream(ids, GOOD)),
            engine.generate(ids, SamplingParams(**TINY_P)),
            engine.generate(ids, SamplingParams(**NAN)), collect(engine.stream(ids, SamplingParams(**NAN))),
            engine.generate(ids, SamplingParams(**BAD_BAN)),
        ]
        tasks = [asyncio.ensure_future(w) for w in work]
        await until(lambda: engine.load()["num_waiting_reqs"] == len(tasks))
    finally:
        await engine.resume()
    good, good2, streamed, tiny_p, nan, nan_stream, bad_ban = await asyncio.wait_for(
        asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    # A top-p nucleus this small is the most likely token alone: sampling it is greedy decoding.
    for result in (good, good2, streamed[-1], tiny_p):
        assert result.output_ids == alone.output_ids and result.finish_reason == {"type": "length", "length": 24}
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert [t for delta in streamed[:-1] for t in delta.token_ids] == alone.output_ids
    for failed in (nan, nan_stream):
        assert isinstance(failed, RuntimeError) and "not finite" in str(failed)
    assert isinstance(bad_ban, RuntimeError) and "out of bounds" in str(bad_ban)
    assert engine.load()["num_running_reqs"] == engine.load()["num_waiting_reqs"] == 0


async def test_a_request_whose_prefill_fails_fails_alone(engine):
    """The Engine API takes prompt ids unchecked (the protocol checks them against the tokenizer,
    whose vocabulary can be larger than the model's): an id with no embedding fails its prefill."""
    ids = prompt(engine.tokenizer, "Write some digits.")
    alone = await engine.generate(ids, GOOD)
    tokens = engine.stream(ids, SamplingParams(max_new_tokens=60, ignore_eos=True))
    await anext(tokens)  # a token sampled: under way (polling the engine's load can miss a short request)
    running = asyncio.ensure_future(collect(tokens))
    await engine.pause("in_place")  # the three below are prefilled together first
    try:
        tasks = [asyncio.ensure_future(engine.generate(p, GOOD)) for p in (ids, ids[:-1] + [10**6], ids)]
        await until(lambda: engine.load()["num_waiting_reqs"] == len(tasks))
    finally:
        await engine.resume()
    first, bad, last = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    assert first.output_ids == last.output_ids == alone.output_ids
    assert isinstance(bad, RuntimeError) and "prefill" in str(bad)
    assert len((await asyncio.wait_for(running, WAIT_S))[-1].output_ids) == 60


async def test_a_bad_newcomer_fails_alone_and_the_running_batch_goes_on(engine):
    ids = prompt(engine.tokenizer, "Give me a long number.")
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    alone = await engine.generate(ids, long)
    tokens = engine.stream(ids, long)
    await anext(tokens)  # under way
    running = asyncio.ensure_future(collect(tokens))
    with pytest.raises(RuntimeError, match="not finite"):
        await asyncio.wait_for(engine.generate(ids, SamplingParams(**NAN)), WAIT_S)
    items = await asyncio.wait_for(running, WAIT_S)
    assert items[-1].output_ids == alone.output_ids and items[-1].finish_reason["type"] == "length"
    assert engine.stats["failed"] >= 1


async def test_any_integer_seed_samples_reproducibly(engine):
    """Seeds are taken modulo 2**64, the seeds a torch.Generator holds."""
    ids = prompt(engine.tokenizer, "Write some digits.")
    seeded = lambda seed: engine.generate(ids, SamplingParams(max_new_tokens=12, sampling_seed=seed, ignore_eos=True))  # noqa: E731
    huge, reduced, negative, top = await asyncio.wait_for(asyncio.gather(
        seeded(2**70), seeded(2**70 % 2**64), seeded(-1), seeded(2**64 - 1)), WAIT_S)
    assert huge.output_ids == reduced.output_ids and negative.output_ids == top.output_ids


async def test_engine_server_answers_a_failed_request_with_an_error_and_serves_the_rest(engine):
    ids = prompt(engine.tokenizer, "Write some digits.")
    body = lambda params, **extra: {"input_ids": ids, "sampling_params": params, **extra}  # noqa: E731
    good_params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    async with RunningApp(create_engine_app(engine, "tiny", "tiny")) as url, \
            httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
        alone = (await http.post("/generate", json=body(good_params))).json()

        lines: list[str] = []

        async def good_stream() -> list[str]:
            async with http.stream("POST", "/generate", json=body(good_params, stream=True)) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
            return lines

        streaming = asyncio.ensure_future(good_stream())
        await until(lambda: lines)  # a line streamed: under way
        failed, failed_stream, tiny_p, seeded, reduced = await asyncio.wait_for(asyncio.gather(
            http.post("/generate", json=body(NAN)),
            http.post("/generate", json=body(NAN, stream=True)),
            http.post("/generate", json=body(TINY_P)),
            http.post("/generate", json=body({"max_new_tokens": 8, "sampling_seed": 2**70, "ignore_eos": True})),
            http.post("/generate", json=body({"max_new_tokens": 8, "sampling_seed": 2**70 % 2**64, "ignore_eos": True})),
        ), WAIT_S)
        streamed = await asyncio.wait_for(streaming, WAIT_S)
    assert failed.status_code == 500 and "not finite" in failed.json()["error"]["message"]
    events = [line[5:].strip() for line in failed_stream.text.splitlines() if line.startswith("data:")]
    assert failed_stream.status_code == 200 and events[-1] == "[DONE]"
    assert "not finite" in json.loads(events[-2])["error"]["message"]
    assert tiny_p.status_code == 200 and len(tiny_p.json()["output_ids"]) == 24
    # Seeds are taken modulo 2**64 (what torch.Generator holds): 2**70 is a seed like any other.
    assert seeded.status_code == reduced.status_code == 200
    assert seeded.json()["output_ids"] == reduced.json()["output_ids"]
    last = json.loads([line[5:] for line in streamed if line.startswith("data:")][-2])
    assert last["output_ids"] == alone["output_ids"] and last["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("transport", ["in_process", "http"])
async def test_gateway_engine_clients_raise_a_failed_request_as_an_engine_error(engine, transport):
    """What the gateway sees: the failed request's `EngineError` (500: the engine failed it), at
    once or from the stream; the others' answers."""
    ids = prompt(engine.tokenizer, "Write some digits.")
    body = lambda params: {"input_ids": ids, "sampling_params": params, "return_logprob": True}  # noqa: E731
    good = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    async with RunningApp(create_engine_app(engine, "tiny", "tiny")) as url:
        client = InProcessEngineClient(engine) if transport == "in_process" else await HTTPEngineClient(url).connect()
        alone = await client.generate(body(good))

        async def stream(params) -> list:
            return [chunk async for chunk in client.generate_stream(body(params))]

        await engine.pause("in_place")  # one batch
        try:
            tasks = [asyncio.ensure_future(c) for c in (
                client.generate(body(good)), stream(good), client.generate(body(NAN)), stream(NAN))]
            await until(lambda: engine.load()["num_waiting_reqs"] == len(tasks))
        finally:
            await engine.resume()
        whole, streamed, failed, failed_stream = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
        await client.close()
    assert whole["output_ids"] == [t for chunk in streamed for t in chunk["output_ids"]] == alone["output_ids"]
    assert streamed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert isinstance(failed, EngineError) and failed.status == 500 and "not finite" in str(failed)
    assert isinstance(failed_stream, EngineError) and "not finite" in str(failed_stream)
