"""LoRA adapters in the embedded engine, on the real tiny model, against the owner of the numbers:
PEFT, which made the adapters. An adapter's log-probs in prefill, decode (the engine's own decoder
and transformers' forward), chunked prefill and input scoring are PEFT's; rows of several
adapters and of the bare base decode in one batch exactly as each does alone, the base rows as
the model without adapters; a step without adapter rows does no adapter work; what cannot be
served is refused; and SGLang's protocol for all of it over HTTP. The log-prob and mixed-batch
tests also run with the engine on CUDA where a GPU exists. The slots over time (eviction, waiting,
swaps, unloading) are `test_engine_adapter_slots.py`'s."""

from __future__ import annotations

import asyncio
import shutil
from itertools import product
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from flywheel.models import load_model, lora_batch
from flywheel.models.lora_adapter import AdapterError, LoraAdapter, read_adapter
from flywheel.models.lora_batch import AdapterTable, Rows
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.serve.engine.server import create_engine_app

from engine_adapters import GREEDY, TEXTS, TOL, fresh_engine, root_of
from factories import RunningApp, prompt, recomputed_logprobs
from waiting import until

PRODUCTS = ["dense", "padded", "gathered", "grouped", "rows"]
"""The ways `lora_batch` computes several adapters' deltas, each forced in turn."""


def use_products(monkeypatch: pytest.MonkeyPatch, products: str) -> None:
    """Several adapters' deltas by `products` on every device, in tables and engines made after:
    dense, padded over the slots' range or over the used slots gathered, grouped, or by row (where
    every row has an adapter; else padded)."""
    monkeypatch.setattr(lora_batch, "DENSE_COLUMNS", {"cpu": 512, "cuda": 8192} if products == "dense" else {})
    monkeypatch.setattr(lora_batch, "PADDED_SPREAD", 0 if products == "gathered" else lora_batch.PADDED_SPREAD)
    monkeypatch.setattr(lora_batch, "PADDED_WASTE", {"grouped": 0, "gathered": 1e9}.get(products, lora_batch.PADDED_WASTE))
    monkeypatch.setattr(lora_batch, "ROW_TOKENS", 1 if products == "rows" else 10**9)
    monkeypatch.setattr(lora_batch, "ROW_RANKS", 0)


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; none here"))])


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
async def test_an_adapters_logprobs_are_peft_s(options, device, engine_adapters, model_and_tokenizer):
    """Prefill (the first token), decode steps (the rest) and input scoring of each adapter give
    the log-probs of a PEFT model with that adapter; the adapters change them."""
    model, tokenizer = model_and_tokenizer
    engine = fresh_engine(root_of(engine_adapters), device, **options)
    ids = prompt(tokenizer, TEXTS[2])
    try:
        plain = await engine.generate(ids, SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5))
        for name in ("alice", "bob", "carol"):
            params = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=5, logprob_start_len=0)
            result = await engine.generate(ids, params, adapter=name)
            peft = engine_adapters[name][1]
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
async def test_rows_of_many_adapters_and_the_base_decode_together_as_alone(options, products, device, engine_adapters,
                                                                          model_and_tokenizer, monkeypatch):
    """Three adapters (ranks 4, 16 and 3) and base rows, prompts of different lengths, greedy and
    seeded: each row of the mixed batch gets the tokens and log-probs it gets alone, with its
    adapter's version; the base rows are the model's without adapters. Both ways of computing
    several adapters' deltas (`lora_batch`: dense, padded, grouped, by row: there without the base
    rows)."""
    use_products(monkeypatch, products)
    model, tokenizer = model_and_tokenizer
    engine = fresh_engine(root_of(engine_adapters), device, **options)
    seeded = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=11, ignore_eos=True)
    names = ["alice", None, "bob", "carol", None, "alice", "bob", "carol"]
    if products == "rows":  # only where every row has an adapter
        names = [name or "bob" for name in names]
    work = [(prompt(tokenizer, TEXTS[i % len(TEXTS)]), GREEDY if i % 2 else seeded, name) for i, name in enumerate(names)]
    try:
        alone, together = await alone_and_together(engine, work)
    finally:
        engine.stop()
    for (ids, _, name), a, b in zip(work, alone, together):
        assert a.output_ids == b.output_ids and len(b.output_ids) == 16
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert b.versions == [f"{name}@1" if name else "0"] * 16
        reference = engine_adapters[name][1] if name else model
        assert b.logprobs == pytest.approx(recomputed_logprobs(reference, ids, b.output_ids), abs=TOL)


@pytest.mark.parametrize("products", PRODUCTS)
@DEVICES
async def test_bfloat16_rows_of_many_adapters_stay_near_peft(products, device, engine_adapters, model_and_tokenizer, monkeypatch):
    """In bfloat16 (ranks padded to 8 for the grouped products; on CUDA those are CUTLASS's
    kernels): a mixed batch's log-probs stay within bfloat16 rounding of PEFT's float32 ones."""
    use_products(monkeypatch, products)
    model, tokenizer = model_and_tokenizer
    engine = fresh_engine(root_of(engine_adapters), device, torch.bfloat16)
    names = ["alice", "bob", "carol", "bob" if products == "rows" else None]  # by row: only where every row has one
    work = [(prompt(tokenizer, TEXTS[i]), GREEDY, name) for i, name in enumerate(names)]
    try:
        _, together = await alone_and_together(engine, work)
    finally:
        engine.stop()
    for (ids, _, name), result in zip(work, together):
        reference = engine_adapters[name][1] if name else model
        assert result.logprobs == pytest.approx(recomputed_logprobs(reference, ids, result.output_ids), abs=0.1)


async def test_a_step_without_adapter_rows_does_no_lora_work(engine_adapters, model_and_tokenizer, monkeypatch):
    """With an adapter resident, base-only requests (decode, prefill, input scoring) never reach
    the batched products nor the hooks; a request with the adapter does."""
    _, tokenizer = model_and_tokenizer
    calls = []
    for method in ("add", "applied"):
        original = getattr(Rows, method)
        monkeypatch.setattr(Rows, method, lambda self, *a, _original=original, _name=method: calls.append(_name) or _original(self, *a))
    engine = fresh_engine(root_of(engine_adapters), own_decoder=True)
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


def test_what_an_adapter_directory_cannot_serve_is_refused(engine_adapters, model_and_tokenizer, tmp_path):
    """DoRA, trained whole modules (`modules_to_save`), an adapted output head, a layer of other
    shapes, a directory without an adapter: each refused with a reason, never served wrong."""
    model, _ = model_and_tokenizer
    table = AdapterTable(model, 2)
    table.check(read_adapter(engine_adapters["bob"][0]))
    for name, arguments in {"dora": dict(use_dora=True), "saved": dict(modules_to_save=["lm_head"])}.items():
        copy, _ = load_model("tiny")
        get_peft_model(copy, LoraConfig(r=4, target_modules=["q_proj"], **arguments)).save_pretrained(tmp_path / name)
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(tmp_path / "dora")
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_adapter(tmp_path / "saved")
    for name, layer, shape in (("head", "lm_head", (4, 128)), ("wide", "model.layers.0.mlp.down_proj", (4, 128))):
        shutil.copytree(engine_adapters["alice"][0], tmp_path / name)
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


async def test_sglang_lora_protocol_over_http(engine_adapters, model_and_tokenizer):
    """`/load_lora_adapter` and `/unload_lora_adapter` (admin routes) with SGLang's fields and
    replies, `/generate` with `lora_path` (one name, a list with nulls, streaming, a name found
    under the adapter root), and SGLang's 400 for an adapter the engine does not know."""
    _, tokenizer = model_and_tokenizer
    engine = fresh_engine(root_of(engine_adapters))
    admin = {"Authorization": "Bearer adm"}
    alice = str(engine_adapters["alice"][0])
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
            found = {name: str(engine_adapters[name][0]) for name in ("alice", "bob")}  # found under the root when asked for
            assert unloaded.status_code == 200 and unloaded.json() == {"success": True, "error_message": "", "loaded_adapters": found}
            assert (await http.post("/generate", json={**body, "lora_path": "first"})).status_code == 400
            again = await http.post("/unload_lora_adapter", json={"lora_name": "first"}, headers=admin)
            assert again.status_code == 400 and "does not exist" in again.json()["error_message"]
    finally:
        engine.stop()


@pytest.mark.parametrize("products", PRODUCTS)
def test_an_adapter_with_inf_or_nan_reaches_no_other_row(model_and_tokenizer, monkeypatch, products):
    """One resident adapter's non-finite weights (written into the table directly: reading one
    refuses it) stay in its own rows: the base's rows and another adapter's rows of the same batch
    get exactly their deltas (none for the base)."""
    use_products(monkeypatch, products)
    model, _ = model_and_tokenizer
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
def test_uneven_rows_over_slots_with_a_gap_get_each_their_own_deltas(model_and_tokenizer, monkeypatch, products):
    """Adapters of ranks 4, 2 and 8 in slots 1, 2 and 4 (3 empty), rows over them unevenly and in
    no order (or one a slot), with a base row and without, of one token (a decode step) and of
    three (a prefill), two layers that share their input (q and k, as the decoder fuses them): each
    row's tokens get exactly their own adapter's delta in each layer's columns, the base row's none."""
    use_products(monkeypatch, products)
    model, _ = model_and_tokenizer
    table = AdapterTable(model, slots=4)
    names = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    layers = [table.layers[name] for name in names]
    torch.manual_seed(1)
    written = {slot: {name: (torch.randn(rank, layer.in_features), torch.randn(layer.out_features, rank))
                      for name, layer in zip(names, layers)} for slot, rank in ((1, 4), (2, 2), (4, 8))}
    for slot, matrices in written.items():
        table.write(slot, LoraAdapter(Path(f"slot{slot}"), matrices))
    # with a base row; every row adapted; a row a slot (the padded products' one-token form); a token a row or 3
    for slots, tokens in product(([2, 0, 4, 2, 2, 1, 4], [4, 2, 2, 1, 4, 2], [4, 0, 1, 2]), (1, 3)):
        x = torch.randn(len(slots) * tokens, layers[0].in_features)
        out = torch.zeros(len(x), sum(layer.out_features for layer in layers))
        rows = table.rows(slots)
        rows.add(out, x, layers)
        plan = rows._plan(len(x))  # the products forced are the ones that ran
        every = all(slots)
        ran = (plan.foreign is not None, plan.padded is not None, plan.gathered is not None, plan.row_slots is not None)
        assert ran == {"dense": (True, False, False, False), "padded": (False, True, False, False),
                       "gathered": (False, True, True, False), "grouped": (False, False, False, False),
                       "rows": (False, not every, False, every)}[products]
        adapted = [slot for slot in slots if slot]
        assert plan.padded is None or plan.one_each == (tokens == 1 and len(set(adapted)) == len(adapted))
        for token in range(len(x)):
            slot = slots[token // tokens]
            expected = [x[token] @ a.T @ b.T for a, b in written[slot].values()] if slot else [torch.zeros(out.shape[1])]
            torch.testing.assert_close(out[token], torch.cat(expected), rtol=1e-4, atol=1e-4)


def test_an_adapter_whose_weights_are_not_finite_is_refused(engine_adapters, tmp_path):
    """A diverged adapter (inf or NaN in A or B) is refused when read: in a batch's dense products
    a slot's infinite B would reach every other row, the base's too (0 x inf)."""
    for matrix, value in (("lora_A", float("nan")), ("lora_B", float("inf"))):
        shutil.copytree(engine_adapters["alice"][0], tmp_path / matrix)
        tensors = load_file(tmp_path / matrix / "adapter_model.safetensors")
        tensors[f"base_model.model.model.layers.1.mlp.up_proj.{matrix}.weight"][0, 0] = value
        save_file(tensors, tmp_path / matrix / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match="up_proj's weights are not all finite"):
            read_adapter(tmp_path / matrix)


def test_a_slot_written_again_holds_only_its_new_adapter(model_and_tokenizer):
    """An adapter of lower rank on fewer layers written over another leaves nothing of it: the
    slot's stacks equal those of a table that only ever held the new one."""
    model, _ = model_and_tokenizer
    torch.manual_seed(0)
    wide = {name: (torch.randn(16, layer.in_features), torch.randn(layer.out_features, 16))
            for name, layer in AdapterTable(model, slots=1).layers.items()}
    q = "model.layers.0.self_attn.q_proj"
    narrow = {q: (torch.randn(4, wide[q][0].shape[1]), torch.randn(wide[q][1].shape[0], 4))}
    table, fresh = AdapterTable(model, slots=2), AdapterTable(model, slots=2)
    table.write(1, LoraAdapter(Path("wide"), wide))
    table.write(1, LoraAdapter(Path("narrow"), narrow))
    fresh.write(1, LoraAdapter(Path("wide"), wide))  # the same stacks and rank, slot 1 never written twice
    fresh.write(2, LoraAdapter(Path("narrow"), narrow))
    for layer, stacks in table.low_rank.items():
        assert torch.equal(stacks.a[1], fresh.low_rank[layer].a[2]) and torch.equal(stacks.b[1], fresh.low_rank[layer].b[2])
    assert table.low_rank[table.layers[q]].a[1].abs().sum() > 0
