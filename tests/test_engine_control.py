"""Engine control on the real tiny model: streaming, abort with partial output, the three pause
modes, and weight updates landing between decode steps of generations in flight."""

import asyncio

import pytest
import torch

from flywheel.models import WeightStore, load_model, load_weights
from flywheel.serve.engine import Engine, GenerationResult, SamplingParams, TokenDelta

from factories import prompt, recomputed_logprobs
from waiting import until


@pytest.fixture
def engine(tiny_path):
    model, tokenizer = load_model(tiny_path)
    eng = Engine(model, tokenizer, max_batch_size=8, load_weights=load_weights).start()
    yield eng
    eng.stop()


@pytest.fixture
def perturbed(tmp_path) -> str:
    """A second set of weights for the tiny model, published as version 1."""
    model, _ = load_model("tiny")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return str(WeightStore(tmp_path / "w").publish(model, 1))


LONG = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)


async def take(stream, n: int) -> list:
    items = []
    async for item in stream:
        items.append(item)
        if len(items) == n:
            break
    return items


async def test_stream_deltas_add_up_to_the_result(engine):
    ids = prompt(engine.tokenizer, "Write some digits.")
    items = [item async for item in engine.stream(ids, SamplingParams(max_new_tokens=12, top_logprobs_num=3, sampling_seed=5))]
    deltas, result = items[:-1], items[-1]
    assert all(isinstance(d, TokenDelta) for d in deltas) and isinstance(result, GenerationResult)
    assert [t for d in deltas for t in d.token_ids] == result.output_ids
    assert [lp for d in deltas for lp in d.logprobs] == result.logprobs
    assert len(result.top_logprobs) == len(result.output_ids)
    for token, logprob, top in zip(result.output_ids, result.logprobs, result.top_logprobs):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert logprob <= top[0][1] + 1e-6
        assert any(t == token for t, _ in top) or logprob < top[2][1] + 1e-6


async def test_abort_returns_partial_output(engine):
    ids = prompt(engine.tokenizer, "Give me a long number.")
    task = asyncio.ensure_future(engine.generate(ids, LONG, rid="victim"))
    stream = engine.stream(ids, LONG, rid="watcher")
    await take(stream, 5)  # both are running now
    assert await engine.abort("victim") == 1
    result = await task
    assert result.finish_reason["type"] == "abort" and 0 < len(result.output_ids) < 60
    assert len(result.logprobs) == len(result.versions) == len(result.output_ids)
    await stream.aclose()  # a consumer that leaves aborts its request too
    await until(lambda: engine.load()["num_running_reqs"] == 0)
    assert engine.stats["aborted"] == 2


async def test_pause_abort_ends_everything_and_queues_newcomers(engine):
    ids = prompt(engine.tokenizer, "hello")
    running = asyncio.ensure_future(engine.generate(ids, LONG))
    await until(lambda: engine.load()["num_running_reqs"] > 0, poll_s=0.001)
    await engine.pause("abort")
    assert (await running).finish_reason["type"] == "abort"
    late = asyncio.ensure_future(engine.generate(ids, SamplingParams(max_new_tokens=3)))
    await until(lambda: engine.load()["num_waiting_reqs"] == 1)
    await asyncio.sleep(0.2)  # time passes: the paused engine must not run the newcomer meanwhile
    assert not late.done() and engine.load()["num_waiting_reqs"] == 1
    await engine.resume()
    assert len((await late).output_ids) <= 3


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_weights_swapped_mid_generation_label_later_tokens(engine, perturbed, mode):
    ids = prompt(engine.tokenizer, "Give me a long number.")
    stream = engine.stream(ids, LONG)
    before = await take(stream, 10)
    await engine.pause(mode)
    await engine.update_weights(perturbed, "1")
    await engine.resume()
    rest = [item async for item in stream]
    result = rest[-1]
    assert result.finish_reason == {"type": "length", "length": 60}
    old = result.versions.count("0")  # the engine ran on until the pause
    assert old >= len(before) and old < 60
    assert result.versions == ["0"] * old + ["1"] * (60 - old)
    # After the swap, each token is what the new weights make of the prefix; with `retract`
    # even the cache is recomputed, so they match a fresh forward pass exactly.
    if mode == "retract":
        expected = recomputed_logprobs(engine.model, ids + result.output_ids[:old], result.output_ids[old:])
        assert result.logprobs[old:] == pytest.approx(expected, abs=2e-4)


async def test_update_without_pause_lands_between_steps(engine, perturbed):
    ids = prompt(engine.tokenizer, "Give me a long number.")
    stream = engine.stream(ids, LONG)
    await take(stream, 5)
    seconds = await engine.update_weights(perturbed, "1")
    result = [item async for item in stream][-1]
    assert seconds >= 0 and engine.version == "1"
    assert result.versions[0] == "0" and result.versions[-1] == "1"
    assert result.versions == sorted(result.versions)  # one switch, never back


async def test_failed_update_keeps_serving_the_old_version(engine, tmp_path):
    with pytest.raises(FileNotFoundError):
        await engine.update_weights(str(tmp_path / "nothing"), "7")
    assert engine.version == "0"
    result = await engine.generate(prompt(engine.tokenizer, "hi"), SamplingParams(max_new_tokens=2))
    assert result.versions == ["0"] * len(result.output_ids)
