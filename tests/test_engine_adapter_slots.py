"""The embedded engine's adapter slots over time, on the real tiny model against PEFT: a bounded
set of slots evicts and reloads, a request waits for a slot rather than failing, a new version
replaces an adapter between two steps (the tokens reporting which version sampled them), and
unloading lets the requests that hold an adapter finish while a request waiting for it fails alone."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from flywheel.serve.engine import RequestFailed, SamplingParams
from flywheel.serve.engine.adapters import UnknownAdapter

from engine_adapters import GREEDY, TEXTS, TOL, fresh_engine, root_of
from factories import prompt, recomputed_logprobs
from waiting import until


async def test_a_bounded_set_of_slots_evicts_and_reloads(engine_adapters, model_and_tokenizer, tmp_path):
    """With two slots, three adapters asked for in turn are all served right: the least recently
    used one no request holds is evicted and read again on its next use, as the same version while
    its files are unchanged, as a new one once they changed."""
    _, tokenizer = model_and_tokenizer
    root = tmp_path / "root"
    for name in ("alice", "bob", "carol"):
        shutil.copytree(engine_adapters[name][0], root / name)
    engine = fresh_engine(root, max_loras=2)
    ids = prompt(tokenizer, TEXTS[0])
    served = []
    try:
        for name in ("alice", "bob", "carol", "alice"):
            result = await engine.generate(ids, GREEDY, adapter=name)
            served.append((name, result, engine.load()["resident_adapters"]))
        shutil.rmtree(root / "bob")
        shutil.copytree(engine_adapters["alice-v2"][0], root / "bob")  # bob's files change while it is evicted
        changed = await engine.generate(ids, GREEDY, adapter="bob")
    finally:
        engine.stop()
    assert [resident for _, _, resident in served] == [["alice"], ["alice", "bob"], ["bob", "carol"], ["carol", "alice"]]
    for name, result, _ in served:
        assert result.versions == [f"{name}@1"] * 16
        assert result.logprobs == pytest.approx(recomputed_logprobs(engine_adapters[name][1], ids, result.output_ids), abs=TOL)
    assert changed.versions == ["bob@2"] * 16
    assert changed.logprobs == pytest.approx(recomputed_logprobs(engine_adapters["alice-v2"][1], ids, changed.output_ids), abs=TOL)


async def last(stream):
    """The final item of an engine's `stream` (its `GenerationResult`), read to the end."""
    async for item in stream:
        pass
    return item


async def test_a_request_whose_adapter_finds_every_slot_held_waits(engine_adapters, model_and_tokenizer):
    """One slot, held by a running request: a request for another adapter waits in the queue (it
    does not fail) and is served right once the slot is free, while base rows go on decoding."""
    _, tokenizer = model_and_tokenizer
    engine = fresh_engine(root_of(engine_adapters), max_loras=1)
    ids = prompt(tokenizer, TEXTS[0])
    # long enough that the base row (16 tokens, admitted a poll after alice starts) ends first
    # however loaded the machine: with 40 tokens alice once finished first under a busy suite
    long = SamplingParams(max_new_tokens=240, temperature=0.0, ignore_eos=True)
    try:
        tokens = engine.stream(ids, long, adapter="alice")
        await anext(tokens)  # a token sampled: alice holds the slot
        first = asyncio.ensure_future(last(tokens))
        second = asyncio.ensure_future(engine.generate(ids, GREEDY, adapter="bob"))
        plain = await engine.generate(ids, GREEDY)
        assert not first.done() and engine.load()["num_waiting_reqs"] == 1  # bob waits; the base row did not
        alice, bob = await asyncio.gather(first, second)
    finally:
        engine.stop()
    assert plain.versions == ["0"] * 16
    for name, result in (("alice", alice), ("bob", bob)):
        assert result.logprobs == pytest.approx(recomputed_logprobs(engine_adapters[name][1], ids, result.output_ids), abs=TOL)


async def test_a_new_version_replaces_an_adapter_between_steps(engine_adapters, model_and_tokenizer):
    """While a long request decodes with alice, alice's next version is loaded: nothing fails, the
    request's tokens report alice@1 up to the swap and alice@2 after it, a base row beside it keeps
    the engine's version, and requests started after the swap use only the new weights."""
    _, tokenizer = model_and_tokenizer
    engine = fresh_engine()
    ids = prompt(tokenizer, TEXTS[0])
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)  # far longer than a load takes
    try:
        assert await engine.load_adapter("alice", str(engine_adapters["alice"][0])) == {"alice": str(engine_adapters["alice"][0])}
        deltas = []

        async def read(stream):
            async for item in stream:
                deltas.append(item)
            return item

        running = asyncio.ensure_future(read(engine.stream(ids, long, adapter="alice")))
        plain = asyncio.ensure_future(engine.generate(ids, long))
        await until(lambda: len(deltas) >= 3)
        await engine.load_adapter("alice", str(engine_adapters["alice-v2"][0]))
        assert not running.done()
        after = await engine.generate(ids, GREEDY, adapter="alice")
        swapped, plain = await running, await plain
    finally:
        engine.stop()
    versions = swapped.versions
    switch = versions.index("alice@2")
    assert 0 < switch < len(versions) == 200 and versions == ["alice@1"] * switch + ["alice@2"] * (200 - switch)
    assert plain.versions == ["0"] * 200
    assert after.versions == ["alice@2"] * 16
    assert after.logprobs == pytest.approx(recomputed_logprobs(engine_adapters["alice-v2"][1], ids, after.output_ids), abs=TOL)


async def test_unloading_lets_the_requests_that_hold_an_adapter_finish(engine_adapters, model_and_tokenizer):
    """Unloading refuses the name to new requests at once; a request under way finishes with the
    version it had, and loading the name again serves the new directory beside it."""
    _, tokenizer = model_and_tokenizer
    engine = fresh_engine()
    ids = prompt(tokenizer, TEXTS[0])
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    try:
        await engine.load_adapter("alice", str(engine_adapters["alice"][0]), label="7")
        running = engine.stream(ids, long, adapter="alice")
        await anext(running)  # a token sampled: under way (polling the engine's load can miss a short request)
        assert await engine.unload_adapter("alice") == {}
        with pytest.raises(UnknownAdapter, match="not loaded: alice"):
            await engine.generate(ids, GREEDY, adapter="alice")
        with pytest.raises(UnknownAdapter, match="does not exist"):
            await engine.unload_adapter("alice")
        await engine.load_adapter("alice", str(engine_adapters["alice-v2"][0]), label="8")
        beside = await engine.generate(ids, GREEDY, adapter="alice")
        finished = await last(running)
    finally:
        engine.stop()
    assert finished.versions == ["alice@7"] * 60
    assert finished.logprobs == pytest.approx(recomputed_logprobs(engine_adapters["alice"][1], ids, finished.output_ids), abs=TOL)
    assert beside.versions == ["alice@8"] * 16
    assert beside.logprobs == pytest.approx(recomputed_logprobs(engine_adapters["alice-v2"][1], ids, beside.output_ids), abs=TOL)


async def test_a_request_waiting_for_an_adapter_that_is_unloaded_fails_alone(engine_adapters, model_and_tokenizer):
    """A request waits for the only slot; its adapter is unloaded meanwhile: once admitted it
    fails with the reason, and the request that held the slot finishes. The engine is paused in
    place while the waiting request arrives and its adapter goes, so that the slot's holder (a few
    milliseconds of decoding on the tiny model) cannot finish first."""
    _, tokenizer = model_and_tokenizer
    engine = fresh_engine(max_loras=1)
    ids = prompt(tokenizer, TEXTS[0])
    try:
        for name in ("alice", "bob"):
            await engine.load_adapter(name, str(engine_adapters[name][0]))
        running = engine.stream(ids, SamplingParams(max_new_tokens=40, ignore_eos=True), adapter="alice")
        await anext(running)  # alice's request holds the slot
        await engine.pause("in_place")
        waiting = asyncio.ensure_future(engine.generate(ids, GREEDY, adapter="bob"))
        await until(lambda: engine.load()["num_waiting_reqs"] == 1)
        assert engine.load()["num_running_reqs"] == 1
        await engine.unload_adapter("bob")
        await engine.resume()
        with pytest.raises(RequestFailed, match="its adapter cannot be served: The following requested LoRA adapters are not loaded: bob"):
            await waiting
        assert len((await last(running)).output_ids) == 40
    finally:
        engine.stop()
