"""LoRA adapters in the embedded engine, on the real tiny model, against the owner of the numbers:
PEFT, which made the adapters. An adapter's log-probs in prefill, decode (the engine's own decoder
and transformers' forward), chunked prefill and input scoring are PEFT's; rows of several
adapters and of the bare base decode in one batch exactly as each does alone, the base rows as
the model without adapters; a bounded set of slots evicts and reloads, and a request waits for a
slot rather than failing; a new version replaces an adapter between two steps, the tokens
reporting which version sampled them; and SGLang's protocol for all of it over HTTP. The log-prob
and mixed-batch tests also run with the engine on CUDA where a GPU exists."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from flywheel.models import load_model, lora_batch, place
from flywheel.models.lora_adapter import AdapterError, LoraAdapter, read_adapter
from flywheel.models.lora_batch import AdapterTable, Rows
from flywheel.serve.engine import Engine, RequestFailed, SamplingParams
from flywheel.serve.engine.adapters import UnknownAdapter
from flywheel.serve.engine.server import create_engine_app

from factories import LINEAR, RunningApp, prompt, random_adapters, recomputed_logprobs
from waiting import until

ADAPTERS = {  # name: (seed, LoraConfig arguments); ranks differ, so the table pads
    "alice": (1, dict(r=4, lora_alpha=8, target_modules=LINEAR)),
    "bob": (2, dict(r=16, lora_alpha=16, use_rslora=True, target_modules=LINEAR)),
    "carol": (3, dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"])),  # attention only, an odd rank
    "alice-v2": (4, dict(r=8, lora_alpha=8, target_modules=LINEAR)),  # alice's next version
}
TOL = 2e-4  # a batched decode step's log-prob against one full forward pass, in float32
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
TEXTS = ["Write some digits.", "hi", "What is 12 + 7? Answer with the number only.", "Name a colour, please, any one."]
PRODUCTS = ["dense", "padded", "gathered", "grouped"]
"""The ways `lora_batch` computes several adapters' deltas, each forced in turn."""


def use_products(monkeypatch: pytest.MonkeyPatch, products: str) -> None:
    """Several adapters' deltas by `products` on every device, in tables and engines made after:
    dense, padded over the slots' range or over the used slots gathered, or grouped."""
    monkeypatch.setattr(lora_batch, "DENSE_COLUMNS", {"cpu": 512, "cuda": 8192} if products == "dense" else {})
    monkeypatch.setattr(lora_batch, "PADDED_SPREAD", 0 if products == "gathered" else lora_batch.PADDED_SPREAD)
    monkeypatch.setattr(lora_batch, "PADDED_WASTE", {"grouped": 0, "gathered": 1e9}.get(products, lora_batch.PADDED_WASTE))


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; none here"))])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{name: (directory, its PEFT model)}, under one root directory, one subdirectory each."""
    return random_adapters(tmp_path_factory.mktemp("adapters"), ADAPTERS)


@pytest.fixture(scope="module")
def base(model_and_tokenizer):
    return model_and_tokenizer


def root_of(adapters):
    """The directory all the test adapters are in (an engine's `lora_root`)."""
    return adapters["alice"][0].parent


def fresh_engine(root=None, device="cpu", dtype=torch.float32, **options) -> Engine:
    """A started engine on a tiny model of its own on `device` (adapters found under `root`, if given)."""
    model, tokenizer = load_model("tiny", dtype)
    return Engine(place(model, device), tokenizer, lora_root=str(root) if root else None,
                  **{"max_batch_size": 8, **options}).start()


async def alone_and_together(engine: Engine, work: list[tuple[list[int], SamplingParams, str | None]]):
    """Each request served alone, then all of them admitted in one round and decoded together."""
    alone = [await engine.generate(ids, params, adapter=adapter) for ids, params, adapter in work]
    steps = engine.stats["steps"]
    await engine.pause("in_place")
    try:
        tasks = [asyncio.ensure_future(engine.generate(ids, params, adapter=adapter)) for ids, params, adapter in work]
        await until(lambda: engine.load()["num_waiting_reqs"] == len(work))
    finally:
        await engine.resume()
    together = await asyncio.gather(*tasks)
    assert engine.stats["steps"] - steps < sum(len(r.output_ids) for r in together)  # decoded together
    return alone, together


@pytest.mark.parametrize("options", [{}, {"own_decoder": False}, {"chunked_prefill_size": 7}],
                         ids=["decoder", "transformers-forward", "chunked-prefill"])
@DEVICES
async def test_an_adapters_logprobs_are_peft_s(options, device, adapters, base):
    """Prefill (the first token), decode steps (the rest) and input scoring of each adapter give
    the log-probs of a PEFT model with that adapter; the adapters change them."""
    model, tokenizer = base
    engine = fresh_engine(root_of(adapters), device, **options)
    ids = prompt(tokenizer, TEXTS[2])
    try:
        plain = await engine.generate(ids, SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5))
        for name in ("alice", "bob", "carol"):
            params = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5, logprob_start_len=0)
            result = await engine.generate(ids, params, adapter=name)
            peft = adapters[name][1]
            assert result.logprobs == pytest.approx(recomputed_logprobs(peft, ids, result.output_ids), abs=TOL)
            assert result.input_logprobs[1:] == pytest.approx(recomputed_logprobs(peft, ids[:1], ids[1:]), abs=TOL)
            assert result.versions == [f"{name}@1"] * len(result.output_ids)
            without = recomputed_logprobs(model, ids, result.output_ids)
            assert max(abs(a - b) for a, b in zip(result.logprobs, without)) > 0.1
    finally:
        engine.stop()
    assert plain.logprobs == pytest.approx(recomputed_logprobs(model, ids, plain.output_ids), abs=TOL)


@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("options", [{}, {"own_decoder": False}], ids=["decoder", "transformers-forward"])
@DEVICES
async def test_rows_of_many_adapters_and_the_base_decode_together_as_alone(options, products, device, adapters,
                                                                          base, monkeypatch):
    """Three adapters (ranks 4, 16 and 3) and base rows, prompts of different lengths, greedy and
    seeded: each row of the mixed batch gets the tokens and log-probs it gets alone, with its
    adapter's version; the base rows are the model's without adapters. Both ways of computing
    several adapters' deltas (`lora_batch`: dense, padded, grouped)."""
    use_products(monkeypatch, products)
    model, tokenizer = base
    engine = fresh_engine(root_of(adapters), device, **options)
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=11, ignore_eos=True)
    names = ["alice", None, "bob", "carol", None, "alice", "bob", "carol"]
    work = [(prompt(tokenizer, TEXTS[i % len(TEXTS)]), GREEDY if i % 2 else seeded, name) for i, name in enumerate(names)]
    try:
        alone, together = await alone_and_together(engine, work)
    finally:
        engine.stop()
    for (ids, _, name), a, b in zip(work, alone, together):
        assert a.output_ids == b.output_ids and len(b.output_ids) == 16
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert b.versions == [f"{name}@1" if name else "0"] * 16
        reference = adapters[name][1] if name else model
        assert b.logprobs == pytest.approx(recomputed_logprobs(reference, ids, b.output_ids), abs=TOL)


@pytest.mark.parametrize("products", PRODUCTS)
@DEVICES
async def test_bfloat16_rows_of_many_adapters_stay_near_peft(products, device, adapters, base, monkeypatch):
    """In bfloat16 (ranks padded to 8 for the grouped products; on CUDA those are CUTLASS's
    kernels): a mixed batch's log-probs stay within bfloat16 rounding of PEFT's float32 ones."""
    use_products(monkeypatch, products)
    model, tokenizer = base
    engine = fresh_engine(root_of(adapters), device, torch.bfloat16)
    names = ["alice", "bob", "carol", None]
    work = [(prompt(tokenizer, TEXTS[i]), GREEDY, name) for i, name in enumerate(names)]
    try:
        _, together = await alone_and_together(engine, work)
    finally:
        engine.stop()
    for (ids, _, name), result in zip(work, together):
        reference = adapters[name][1] if name else model
        assert result.logprobs == pytest.approx(recomputed_logprobs(reference, ids, result.output_ids), abs=0.1)


async def test_a_bounded_set_of_slots_evicts_and_reloads(adapters, base, tmp_path):
    """With two slots, three adapters asked for in turn are all served right: the least recently
    used one no request holds is evicted and read again on its next use, as the same version while
    its files are unchanged, as a new one once they changed."""
    _, tokenizer = base
    root = tmp_path / "root"
    for name in ("alice", "bob", "carol"):
        shutil.copytree(adapters[name][0], root / name)
    engine = fresh_engine(root, max_loras=2)
    ids = prompt(tokenizer, TEXTS[0])
    served = []
    try:
        for name in ("alice", "bob", "carol", "alice"):
            result = await engine.generate(ids, GREEDY, adapter=name)
            served.append((name, result, engine.load()["resident_adapters"]))
        shutil.rmtree(root / "bob")
        shutil.copytree(adapters["alice-v2"][0], root / "bob")  # bob's files change while it is evicted
        changed = await engine.generate(ids, GREEDY, adapter="bob")
    finally:
        engine.stop()
    assert [resident for _, _, resident in served] == [["alice"], ["alice", "bob"], ["bob", "carol"], ["carol", "alice"]]
    for name, result, _ in served:
        assert result.versions == [f"{name}@1"] * 16
        assert result.logprobs == pytest.approx(recomputed_logprobs(adapters[name][1], ids, result.output_ids), abs=TOL)
    assert changed.versions == ["bob@2"] * 16
    assert changed.logprobs == pytest.approx(recomputed_logprobs(adapters["alice-v2"][1], ids, changed.output_ids), abs=TOL)


async def test_a_request_whose_adapter_finds_every_slot_held_waits(adapters, base):
    """One slot, held by a running request: a request for another adapter waits in the queue (it
    does not fail) and is served right once the slot is free, while base rows go on decoding."""
    _, tokenizer = base
    engine = fresh_engine(root_of(adapters), max_loras=1)
    ids = prompt(tokenizer, TEXTS[0])
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        first = asyncio.ensure_future(engine.generate(ids, long, adapter="alice"))
        await until(lambda: engine.load()["num_running_reqs"] == 1)
        second = asyncio.ensure_future(engine.generate(ids, GREEDY, adapter="bob"))
        plain = await engine.generate(ids, GREEDY)
        assert not first.done() and engine.load()["num_waiting_reqs"] == 1  # bob waits; the base row did not
        alice, bob = await asyncio.gather(first, second)
    finally:
        engine.stop()
    assert plain.versions == ["0"] * 16
    for name, result in (("alice", alice), ("bob", bob)):
        assert result.logprobs == pytest.approx(recomputed_logprobs(adapters[name][1], ids, result.output_ids), abs=TOL)


async def test_a_new_version_replaces_an_adapter_between_steps(adapters, base):
    """While a long request decodes with alice, alice's next version is loaded: nothing fails, the
    request's tokens report alice@1 up to the swap and alice@2 after it, a base row beside it keeps
    the engine's version, and requests started after the swap use only the new weights."""
    _, tokenizer = base
    engine = fresh_engine()
    ids = prompt(tokenizer, TEXTS[0])
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)  # far longer than a load takes
    try:
        assert await engine.load_adapter("alice", str(adapters["alice"][0])) == {"alice": str(adapters["alice"][0])}
        deltas = []

        async def read(stream):
            async for item in stream:
                deltas.append(item)
            return item

        running = asyncio.ensure_future(read(engine.stream(ids, long, adapter="alice")))
        plain = asyncio.ensure_future(engine.generate(ids, long))
        await until(lambda: len(deltas) >= 3)
        await engine.load_adapter("alice", str(adapters["alice-v2"][0]))
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
    assert after.logprobs == pytest.approx(recomputed_logprobs(adapters["alice-v2"][1], ids, after.output_ids), abs=TOL)


async def test_unloading_lets_the_requests_that_hold_an_adapter_finish(adapters, base):
    """Unloading refuses the name to new requests at once; a request under way finishes with the
    version it had, and loading the name again serves the new directory beside it."""
    _, tokenizer = base
    engine = fresh_engine()
    ids = prompt(tokenizer, TEXTS[0])
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    try:
        await engine.load_adapter("alice", str(adapters["alice"][0]), label="7")
        running = asyncio.ensure_future(engine.generate(ids, long, adapter="alice"))
        await until(lambda: engine.load()["num_running_reqs"] == 1)
        assert await engine.unload_adapter("alice") == {}
        with pytest.raises(UnknownAdapter, match="not loaded: alice"):
            await engine.generate(ids, GREEDY, adapter="alice")
        with pytest.raises(UnknownAdapter, match="does not exist"):
            await engine.unload_adapter("alice")
        await engine.load_adapter("alice", str(adapters["alice-v2"][0]), label="8")
        beside = await engine.generate(ids, GREEDY, adapter="alice")
        finished = await running
    finally:
        engine.stop()
    assert finished.versions == ["alice@7"] * 60
    assert finished.logprobs == pytest.approx(recomputed_logprobs(adapters["alice"][1], ids, finished.output_ids), abs=TOL)
    assert beside.versions == ["alice@8"] * 16
    assert beside.logprobs == pytest.approx(recomputed_logprobs(adapters["alice-v2"][1], ids, beside.output_ids), abs=TOL)


async def test_a_request_waiting_for_an_adapter_that_is_unloaded_fails_alone(adapters, base):
    """A request waits for the only slot; its adapter is unloaded meanwhile: once admitted it
    fails with the reason, and the request that held the slot finishes."""
    _, tokenizer = base
    engine = fresh_engine(max_loras=1)
    ids = prompt(tokenizer, TEXTS[0])
    try:
        for name in ("alice", "bob"):
            await engine.load_adapter(name, str(adapters[name][0]))
        running = asyncio.ensure_future(engine.generate(ids, SamplingParams(max_new_tokens=40, ignore_eos=True), adapter="alice"))
        await until(lambda: engine.load()["num_running_reqs"] == 1)
        waiting = asyncio.ensure_future(engine.generate(ids, GREEDY, adapter="bob"))
        await until(lambda: engine.load()["num_waiting_reqs"] == 1)
        await engine.unload_adapter("bob")
        with pytest.raises(RequestFailed, match="its adapter cannot be served: The following requested LoRA adapters are not loaded: bob"):
            await waiting
        assert len((await running).output_ids) == 40
    finally:
        engine.stop()


async def test_a_step_without_adapter_rows_does_no_lora_work(adapters, base, monkeypatch):
    """With an adapter resident, base-only requests (decode, prefill, input scoring) never reach
    the batched products nor the hooks; a request with the adapter does."""
    _, tokenizer = base
    calls = []
    for method in ("add", "applied"):
        original = getattr(Rows, method)
        monkeypatch.setattr(Rows, method, lambda self, *a, _original=original, _name=method: calls.append(_name) or _original(self, *a))
    engine = fresh_engine(root_of(adapters), own_decoder=True)
    ids = prompt(tokenizer, TEXTS[2])
    scored = SamplingParams(max_new_tokens=16, temperature=0.0, logprob_start_len=0)
    try:
        await engine.generate(ids, GREEDY, adapter="alice")
        assert "add" in calls and "applied" in calls
        calls.clear()
        await asyncio.gather(engine.generate(ids, scored), engine.generate(ids[:5], GREEDY))
        assert engine.load()["resident_adapters"] == ["alice"] and calls == []
    finally:
        engine.stop()


def test_what_an_adapter_directory_cannot_serve_is_refused(adapters, base, tmp_path):
    """DoRA, trained whole modules (`modules_to_save`), an adapted output head, a layer of other
    shapes, a directory without an adapter: each refused with a reason, never served wrong."""
    model, _ = base
    table = AdapterTable(model, 2)
    table.check(read_adapter(adapters["bob"][0]))
    for name, arguments in {"dora": dict(use_dora=True), "saved": dict(modules_to_save=["lm_head"])}.items():
        copy, _ = load_model("tiny")
        get_peft_model(copy, LoraConfig(r=4, target_modules=["q_proj"], **arguments)).save_pretrained(tmp_path / name)
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(tmp_path / "dora")
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_adapter(tmp_path / "saved")
    for name, layer, shape in (("head", "lm_head", (4, 128)), ("wide", "model.layers.0.mlp.down_proj", (4, 128))):
        shutil.copytree(adapters["alice"][0], tmp_path / name)
        tensors = load_file(tmp_path / name / "adapter_model.safetensors")
        tensors[f"base_model.model.{layer}.lora_A.weight"] = torch.zeros(shape)
        tensors[f"base_model.model.{layer}.lora_B.weight"] = torch.zeros(128, 4)
        save_file(tensors, tmp_path / name / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="lm_head is not a linear layer"):
        table.check(read_adapter(tmp_path / "head"))
    with pytest.raises(AdapterError, match="down_proj maps 128 to 128 features; the model's layer maps 384 to 128"):
        table.check(read_adapter(tmp_path / "wide"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path / "nothing")


async def test_sglang_lora_protocol_over_http(adapters, base):
    """`/load_lora_adapter` and `/unload_lora_adapter` (admin routes) with SGLang's fields and
    replies, `/generate` with `lora_path` (one name, a list with nulls, streaming, a name found
    under the adapter root), and SGLang's 400 for an adapter the engine does not know."""
    _, tokenizer = base
    engine = fresh_engine(root_of(adapters))
    admin = {"Authorization": "Bearer adm"}
    alice = str(adapters["alice"][0])
    ids = prompt(tokenizer, TEXTS[0])
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    try:
        async with RunningApp(create_engine_app(engine, "tiny", "tiny", admin_key="adm")) as url, httpx.AsyncClient(base_url=url) as http:
            assert (await http.post("/load_lora_adapter", json={"lora_name": "first", "lora_path": alice})).status_code == 401
            loaded = await http.post("/load_lora_adapter", json={"lora_name": "first", "lora_path": alice}, headers=admin)
            assert loaded.status_code == 200
            assert loaded.json() == {"success": True, "error_message": "", "loaded_adapters": {"first": alice}}
            one = (await http.post("/generate", json={**body, "lora_path": "first"})).json()
            assert one["meta_info"]["weight_version"] == "first@1"
            direct = await engine.generate(ids, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True), adapter="alice")
            assert one["output_ids"] == direct.output_ids
            batch = (await http.post("/generate", json={**body, "input_ids": [ids, ids], "lora_path": ["bob", None]})).json()
            assert [r["meta_info"]["weight_version"] for r in batch] == ["bob@1", "0"]  # bob: found under the root
            streamed = await http.post("/generate", json={**body, "stream": True, "lora_path": "first"})
            assert '"weight_version": "first@1"' in streamed.text and streamed.text.rstrip().endswith("[DONE]")
            for unknown in ("nobody", "../alice"):  # SGLang's shape and message
                refused = await http.post("/generate", json={**body, "lora_path": unknown})
                assert refused.status_code == 400
                assert refused.json()["error"]["message"].startswith(f"The following requested LoRA adapters are not loaded: {unknown}")
            miscounted = await http.post("/generate", json={**body, "lora_path": ["first"] * 3})
            assert miscounted.status_code == 400 and "one entry per prompt" in miscounted.json()["error"]
            bad = await http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"}, headers=admin)
            assert bad.status_code == 400 and bad.json()["success"] is False and "not a LoRA adapter" in bad.json()["error_message"]
            shadow = await http.post("/load_lora_adapter", json={"lora_name": "tiny", "lora_path": alice}, headers=admin)
            assert shadow.status_code == 400 and "served model" in shadow.json()["error_message"]
            unloaded = await http.post("/unload_lora_adapter", json={"lora_name": "first"}, headers=admin)
            found = {name: str(adapters[name][0]) for name in ("alice", "bob")}  # found under the root when asked for
            assert unloaded.status_code == 200 and unloaded.json() == {"success": True, "error_message": "", "loaded_adapters": found}
            assert (await http.post("/generate", json={**body, "lora_path": "first"})).status_code == 400
            again = await http.post("/unload_lora_adapter", json={"lora_name": "first"}, headers=admin)
            assert again.status_code == 400 and "does not exist" in again.json()["error_message"]
    finally:
        engine.stop()


@pytest.mark.parametrize("products", PRODUCTS)
def test_an_adapter_with_inf_or_nan_reaches_no_other_row(base, monkeypatch, products):
    """One resident adapter's non-finite weights (written into the table directly: reading one
    refuses it) stay in its own rows: the base's rows and another adapter's rows of the same batch
    get exactly their deltas (none for the base)."""
    use_products(monkeypatch, products)
    model, _ = base
    table = AdapterTable(model, slots=3)
    layer = "model.layers.0.self_attn.q_proj"
    width = table.layers[layer].in_features, table.layers[layer].out_features
    torch.manual_seed(0)
    good = LoraAdapter(Path("good"), {layer: (torch.randn(4, width[0]), torch.randn(width[1], 4))})
    bad = LoraAdapter(Path("bad"), {layer: (torch.full((4, width[0]), float("nan")), torch.randn(width[1], 4))})
    table.write(1, good)
    table.write(2, bad)
    x = torch.randn(3, width[0])
    out = torch.zeros(3, width[1])
    table.rows([0, 1, 2]).add(out, x, [table.layers[layer]])
    a, b = good.layers[layer]
    assert torch.equal(out[0], torch.zeros(width[1])) and out[2].isnan().all()
    torch.testing.assert_close(out[1], (x[1] @ a.T) @ b.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("products", PRODUCTS)
def test_uneven_rows_over_slots_with_a_gap_get_each_their_own_deltas(base, monkeypatch, products):
    """Adapters of ranks 4, 2 and 8 in slots 1, 2 and 4 (3 empty), rows over them unevenly and in
    no order, with a base row and without, two layers that share their input (q and k, as the
    decoder fuses them): each row gets exactly its own adapter's delta in each layer's columns,
    the base row none."""
    use_products(monkeypatch, products)
    model, _ = base
    table = AdapterTable(model, slots=4)
    names = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    layers = [table.layers[name] for name in names]
    torch.manual_seed(1)
    written = {slot: {name: (torch.randn(rank, layer.in_features), torch.randn(layer.out_features, rank))
                      for name, layer in zip(names, layers)} for slot, rank in ((1, 4), (2, 2), (4, 8))}
    for slot, matrices in written.items():
        table.write(slot, LoraAdapter(Path(f"slot{slot}"), matrices))
    for slots in ([2, 0, 4, 2, 2, 1, 4], [4, 2, 2, 1, 4, 2]):  # with a base row; every row adapted
        x = torch.randn(len(slots), layers[0].in_features)
        out = torch.zeros(len(slots), sum(layer.out_features for layer in layers))
        rows = table.rows(slots)
        rows.add(out, x, layers)
        plan = rows._plan(len(slots))  # the products forced are the ones that ran
        assert (plan.foreign is not None, plan.padded is not None, plan.gathered is not None) == {
            "dense": (True, False, False), "padded": (False, True, False), "gathered": (False, True, True),
            "grouped": (False, False, False)}[products]
        for row, slot in enumerate(slots):
            expected = [x[row] @ a.T @ b.T for a, b in written[slot].values()] if slot else [torch.zeros(out.shape[1])]
            torch.testing.assert_close(out[row], torch.cat(expected), rtol=1e-4, atol=1e-4)


def test_an_adapter_whose_weights_are_not_finite_is_refused(adapters, tmp_path):
    """A diverged adapter (inf or NaN in A or B) is refused when read: in a batch's dense products
    a slot's infinite B would reach every other row, the base's too (0 x inf)."""
    for matrix, value in (("lora_A", float("nan")), ("lora_B", float("inf"))):
        shutil.copytree(adapters["alice"][0], tmp_path / matrix)
        tensors = load_file(tmp_path / matrix / "adapter_model.safetensors")
        tensors[f"base_model.model.model.layers.1.mlp.up_proj.{matrix}.weight"][0, 0] = value
        save_file(tensors, tmp_path / matrix / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match="up_proj's weights are not all finite"):
            read_adapter(tmp_path / matrix)
