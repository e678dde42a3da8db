"""The embedded engine's chunked prefill, its admission order and its dtype key, on the real tiny
model: a round's plan in either order (shortest prompt first, with its bound on overtaking, or
arrival; only a prompt longer than a round split), a short prompt behind a long one served first
unless first come, rounds back to back while prompts wait (until the streams' stall bound; never
with a full batch), a prompt prefilled in pieces samples what a whole prefill samples, running
streams get tokens while a long prompt is prefilled, a request aborted mid-prefill ends alone; a bfloat16 engine (weights
and KV cache) samples with log-probs close to the float32 model's and loads float32 weights."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from flywheel.config import load_config
from flywheel.models import WeightStore, load_model, load_weights
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.serve.engine.chunked import OVERTAKEN_LIMIT, PartialPrefill, plan
from flywheel.serve.loop import ServeLoop

from factories import recomputed_logprobs
from waiting import until

LONG = [(7 * i) % 1900 + 50 for i in range(120)]
"""A 120-token prompt of ids the tiny model knows."""


def started(model_and_tokenizer, chunk: int, max_stall_s: float = 0.0, rows: int = 4) -> Engine:
    model, tokenizer = model_and_tokenizer
    return Engine(model, tokenizer, max_batch_size=rows, chunked_prefill_size=chunk, load_weights=load_weights,
                  max_stall_s=max_stall_s).start()


def waiting(tokens: int, done: int | None = None, overtaken: int = 0, output: int = 0) -> SimpleNamespace:
    return SimpleNamespace(tokens=[1] * tokens, partial=None if done is None else PartialPrefill(done=done),
                           overtaken=overtaken, output_ids=[2] * output)


def test_first_come_a_round_prefills_whole_prompts_in_order_then_a_piece_of_a_longer_one():
    a, b, c, d = waiting(10), waiting(20), waiting(100), waiting(5)
    work = plan([a, b, c, d], room=4, budget=64, policy="fcfs")
    assert work.whole == [a, b] and work.piece == (c, 34)  # d waits behind c
    assert plan([a, b, c], room=1, budget=64, policy="fcfs").whole == [a]
    started_long = waiting(100, done=90)
    work = plan([started_long, d], room=4, budget=64, policy="fcfs")
    assert work.whole == [d] and work.piece == (started_long, 10)  # its last piece shares the round
    assert plan([started_long, d], room=1, budget=64, policy="fcfs").whole == []  # its row is the last
    assert plan([started_long], room=0, budget=64, policy="fcfs").piece is None  # no row to join: it waits
    assert a.overtaken == b.overtaken == c.overtaken == d.overtaken == 0


def test_a_prompt_that_fits_in_a_round_is_not_split_it_waits_for_the_next():
    a, b, fits, d = waiting(10), waiting(20), waiting(40), waiting(5)
    for policy in ("fcfs", "shortest-first"):
        work = plan([a, b, fits, d], room=4, budget=64, policy=policy)
        assert work.piece is None and fits not in work.whole
    assert plan([a, b, fits, d], room=4, budget=64, policy="fcfs").whole == [a, b]  # d waits behind it
    assert plan([fits], room=4, budget=64, policy="fcfs").whole == [fits]  # the next round takes it whole


def test_shortest_first_admits_the_least_prompt_left_first():
    a, b, c, d = waiting(100), waiting(20), waiting(10), waiting(20)
    work = plan([a, b, c, d], room=4, budget=64, policy="shortest-first")
    assert work.whole == [c, b, d] and work.piece == (a, 14)  # equal prompts keep their arrival order
    work = plan([a, b, c, d], room=2, budget=64, policy="shortest-first")
    assert work.whole == [c, b] and work.piece is None
    assert (a.overtaken, b.overtaken, c.overtaken, d.overtaken) == (1, 0, 0, 0)  # only a was passed by a later one
    started = waiting(300, done=200)
    assert plan([c, started], room=4, budget=64, policy="shortest-first").piece == (started, 64)  # it goes on first


def test_shortest_first_admits_a_request_passed_over_too_often_before_shorter_ones():
    a, b = waiting(100), waiting(20)
    for _ in range(OVERTAKEN_LIMIT):
        assert plan([a, b], room=1, budget=64, policy="shortest-first").whole == [b]
    assert a.overtaken == OVERTAKEN_LIMIT
    assert plan([a, b], room=1, budget=64, policy="shortest-first").piece == (a, 64)  # passed over enough: first
    assert plan([a, waiting(5, overtaken=OVERTAKEN_LIMIT), b], room=4, budget=200,
                policy="shortest-first").whole[0] is a  # the starved go first in their arrival order


def test_shortest_first_admits_a_request_sent_back_mid_generation_first():
    short, retracted = waiting(10), waiting(60, output=40)  # sent back mid-generation by a retract pause
    assert plan([short, retracted], room=4, budget=200, policy="shortest-first").whole == [retracted, short]


@pytest.mark.parametrize("policy", ["shortest-first", "fcfs"])
async def test_a_short_prompt_behind_a_long_one_gets_its_first_token_first_unless_first_come(model_and_tokenizer, policy):
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, max_batch_size=4, chunked_prefill_size=8, schedule_policy=policy).start()
    try:
        await engine.pause("in_place")  # both wait for the same round
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        long = asyncio.create_task(engine.generate(LONG, params))
        short = asyncio.create_task(engine.generate([5, 6, 7], params))
        await until(lambda: engine.load()["num_waiting_reqs"] >= 2)
        await engine.resume()
        long, short = await long, await short
    finally:
        engine.stop()
    assert (short.first_token_s < long.first_token_s) == (policy == "shortest-first")  # both queued at once


@pytest.mark.parametrize("max_stall_s", [0.0, 3600.0])
async def test_while_prompts_wait_rounds_run_back_to_back_until_the_streams_stall_limit(model_and_tokenizer, max_stall_s):
    """Four prompts queued together, one per round: with a stall limit no decode step comes
    between the rounds, so every first token comes before any request's second (its last); with
    0, a decode step after each round finishes the first request before the last one starts."""
    engine = started(model_and_tokenizer, chunk=3, max_stall_s=max_stall_s)
    try:
        await engine.pause("in_place")
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate([5 + i, 6, 7], params)) for i in range(4)]
        await until(lambda: engine.load()["num_waiting_reqs"] >= 4)
        await engine.resume()
        results = [await task for task in tasks]
    finally:
        engine.stop()
    prefill_first = max(r.first_token_s for r in results) < min(r.total_s for r in results)
    assert prefill_first == (max_stall_s > 0)


async def test_a_full_batch_decodes_though_prompts_wait_and_the_streams_are_young(model_and_tokenizer):
    engine = started(model_and_tokenizer, chunk=64, max_stall_s=3600.0, rows=2)  # no row for the third
    try:
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        results = await asyncio.wait_for(asyncio.gather(*(engine.generate([5, 6, 7 + i], params) for i in range(3))), 60)
    finally:
        engine.stop()
    assert [len(r.output_ids) for r in results] == [5, 5, 5]


async def test_a_prompt_prefilled_in_pieces_samples_what_a_whole_prefill_samples(model_and_tokenizer):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5, ignore_eos=True)
    results = []
    for chunk in (7, 100_000):
        engine = started(model_and_tokenizer, chunk)
        try:
            results.append(await engine.generate(LONG, params))
        finally:
            engine.stop()
    pieces, whole = results
    assert pieces.output_ids == whole.output_ids
    assert pieces.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert pieces.logprobs == pytest.approx(recomputed_logprobs(model_and_tokenizer[0], LONG, pieces.output_ids), abs=2e-4)


async def test_running_streams_get_tokens_while_a_long_prompt_is_prefilled(model_and_tokenizer):
    engine = started(model_and_tokenizer, chunk=8)  # LONG takes 15 rounds
    try:
        received: list[int] = []

        async def running() -> None:
            async for item in engine.stream([5, 6, 7], SamplingParams(max_new_tokens=400, ignore_eos=True)):
                received.extend(getattr(item, "token_ids", []))

        task = asyncio.create_task(running())
        await until(lambda: received)
        before = len(received)
        result = await engine.generate(LONG, SamplingParams(max_new_tokens=1))
        assert len(received) - before >= 14  # a decode step after each of its pieces but the last
        assert len(result.output_ids) == 1
        await engine.abort()
        await task
    finally:
        engine.stop()


async def test_a_request_aborted_mid_prefill_ends_alone(model_and_tokenizer):
    engine = started(model_and_tokenizer, chunk=1)  # LONG takes 120 rounds
    try:
        other = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True)))
        long = asyncio.create_task(engine.generate(LONG, SamplingParams(max_new_tokens=4), rid="long"))
        await until(lambda: engine.stats["steps"] >= 10)  # both admitted: the long one part-prefilled
        assert await engine.abort("long") == 1
        assert (await long).finish_reason["type"] == "abort"
        assert len((await other).output_ids) == 60
        assert engine.load()["num_waiting_reqs"] == engine.load()["num_running_reqs"] == 0
        again = await engine.generate(LONG, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(again.output_ids) == 3
    finally:
        engine.stop()


async def test_a_bfloat16_engine_samples_close_to_the_float32_model_and_loads_float32_weights(tiny_path, tmp_path):
    reference, _ = load_model(tiny_path)
    model, tokenizer = load_model(tiny_path, torch.bfloat16)
    engine = Engine(model, tokenizer, max_batch_size=4, load_weights=load_weights).start()
    try:
        params = SamplingParams(max_new_tokens=32, temperature=1.0, sampling_seed=1, ignore_eos=True)
        results = await asyncio.gather(*(engine.generate([5 + i, 60, 70], params) for i in range(3)))
        assert engine._batch.dtype == torch.bfloat16
        gaps = [abs(a - b) for r in results
                for a, b in zip(r.logprobs, recomputed_logprobs(reference, r.prompt_ids, r.output_ids))]
        assert 0 < sum(gaps) / len(gaps) < 0.05  # bfloat16 is not float32, but close
        store = WeightStore(tmp_path / "store")
        store.publish(reference, 1)
        await engine.update_weights(str(store.path(1)), "1")
        assert next(model.parameters()).dtype == torch.bfloat16
        assert len((await engine.generate([5, 6], params)).output_ids) == 32
    finally:
        engine.stop()


async def test_serve_config_sets_the_embedded_engines_dtype_and_prefill_chunk(nats_url, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.dtype=bfloat16", "serve.chunked_prefill_size=16",
                                "serve.own_decoder=false"])
    loop = ServeLoop(config, nats_url)
    await loop.start()
    try:
        assert next(loop.engine.model.parameters()).dtype == torch.bfloat16
        assert loop.engine.chunked_prefill_size == 16
        await loop.engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert loop.engine._decoder is None  # transformers' forward, as asked (by default the engine's own)
    finally:
        await loop.stop()
