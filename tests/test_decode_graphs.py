"""Decode steps replayed from CUDA graphs (`flywheel/serve/engine/decode_graphs.py`) against the
eager decoder's steps over the same cache: the same logits and the same keys and values for the
live rows, with adapter rows and base rows mixed, while the batch narrows (another bucket), the
cache grows (every graph captured again) and the weights change (again). On a CPU the padded,
fixed-shape step runs eagerly; on CUDA it is captured and replayed. The engine's own tests on CUDA
(`test_engine_lora.py`, `test_gpu_path.py`) run through the graphs too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.models import load_model, lora_batch
from flywheel.models.lora_adapter import LoraAdapter
from flywheel.models.lora_batch import AdapterTable
from flywheel.serve.engine.decode_graphs import DecodeGraphs
from flywheel.serve.engine.decoder import Decoder
from flywheel.serve.engine.kv_cache import KVBatch

DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; none here"))])


def adapter_table(model: torch.nn.Module) -> AdapterTable:
    """Three slots: rank 4 on every linear layer in slot 1, rank 8 on q and v in slot 2, slot 3 empty."""
    table = AdapterTable(model, slots=3)
    table.write(1, random_adapter(table, 4, seed=1))
    table.write(2, random_adapter(table, 8, seed=2, kinds=("q_proj", "v_proj")))
    return table


def random_adapter(table: AdapterTable, rank: int, seed: int, kinds: tuple[str, ...] | None = None) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    return LoraAdapter(Path(f"adapter{seed}"), {
        name: (torch.randn(rank, layer.in_features, generator=generator) * 0.1,
               torch.randn(layer.out_features, rank, generator=generator) * 0.1)
        for name, layer in table.layers.items() if kinds is None or name.endswith(kinds)})


@pytest.mark.parametrize("adapters", [True, False], ids=["adapters", "base"])
@DEVICES
def test_replayed_steps_give_the_eager_decoders_logits(device, adapters, tiny_path, monkeypatch):
    """Five rows (bucket 8), three leave (bucket 4), three join in slots the padded rows wrote
    (bucket 8 again: its first graph replayed after another was captured in the shared pool), an
    adapter rewritten in place while the graphs hold it, the cache grown, new weights: every
    step's logits, and the live rows' keys and values, are the eager step's."""
    monkeypatch.setattr(lora_batch, "DENSE_COLUMNS", {"cpu": 8192, "cuda": 8192})
    model = load_model(tiny_path)[0].to(device)
    decoder = Decoder.build(model, 8)
    table = adapter_table(model)
    eager, ours = (KVBatch(model, 8, first_columns=32) for _ in range(2))
    graphs = DecodeGraphs(decoder, ours, table)
    generator = torch.Generator().manual_seed(1)

    def sequences(*lengths: int) -> list[list[int]]:
        return [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]

    slots = [1, 0, 2, 1, 0] if adapters else [0] * 5
    held = []
    with torch.inference_mode():
        prefill = eager.prefill(model, sequences(20, 1, 19, 2, 18), pad_id=0)
        eager.add(prefill)
        ours.add(prefill)
        tokens = prefill.logits.argmax(-1)
        for step in range(16):
            if step == 4:  # two rows leave: 3 rows, bucket 4
                order = eager.retain([0, 2, 4])
                assert ours.retain([0, 2, 4]) == order
                tokens, slots = tokens[order], [slots[i] for i in order]
            if step == 6:  # three join (slots 3-5, whose column 0 padded rows wrote): bucket 8 again
                joining = eager.prefill(model, sequences(5, 9, 3), pad_id=0)
                eager.add(joining)
                ours.add(joining)
                tokens = torch.cat([tokens, joining.logits.argmax(-1)])
                slots += [2, 0, 1] if adapters else [0] * 3
            if step == 8:  # slot 1 rewritten in place (no higher rank): the graphs read the new matrices
                table.write(1, random_adapter(table, 4, seed=7))
            if step == 14:  # new weights: the decoder's fused copy is rebuilt, the graphs must follow
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.02)
                decoder.refresh()
            rows = table.rows(slots)
            assert graphs.serves(rows)
            expected = eager.step(model, tokens, decoder, rows)
            got = ours.step(model, tokens, decoder, rows, graphs)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
            held.append(graphs._held)
            tokens = expected.argmax(-1)
    assert eager.columns == 64 and len(set(held)) == 3  # the cache grew at 33 tokens (step 12), the weights changed
    for layer in range(eager.layer_count):
        for store in ("keys", "values"):
            for row, length in enumerate(eager.lengths.tolist()):
                torch.testing.assert_close(getattr(ours, store)[layer][row, :, :length],
                                           getattr(eager, store)[layer][row, :, :length], rtol=0, atol=1e-5)
    if device == "cuda":  # bucket 8, bucket 4; bucket 8 again after the cache grew and after the new weights
        assert graphs.captures == 4 and graphs.failed is None


def test_adapter_tables_beyond_the_dense_products_step_eagerly(tiny_path, monkeypatch):
    """A table whose slots' columns exceed the dense products' limit cannot be replayed with its
    adapters (the engine then steps eagerly); base rows still can."""
    monkeypatch.setattr(lora_batch, "DENSE_COLUMNS", {"cpu": 8, "cuda": 8})
    model = load_model(tiny_path)[0]
    table = adapter_table(model)
    graphs = DecodeGraphs(Decoder.build(model, 4), KVBatch(model, 4), table)
    assert not table.fixed_fits and not graphs.serves(table.rows([1, 0])) and graphs.serves(None)


def test_the_graphs_are_dropped_when_any_tensor_they_captured_is_replaced(tiny_path):
    """A graph replays on the addresses it captured. Any one layer's keys or values allocated anew
    (a cache given back and grown again, where the first layer's tensor may get its old address
    back and another layer's not), the decoder's fused weights rebuilt, the adapter stacks
    reallocated for a higher rank: each changes what the graphs hold (so they are captured again);
    a step that replaces nothing keeps them."""
    model = load_model(tiny_path)[0]
    table = adapter_table(model)
    decoder, batch = Decoder.build(model, 4), KVBatch(model, 4)
    graphs = DecodeGraphs(decoder, batch, table)
    with torch.inference_mode():
        batch.add(batch.prefill(model, [[5, 6, 7], [8, 9]], pad_id=0))
    held = []

    def hold() -> None:
        graphs._drop_stale()
        held.append(graphs._held)

    hold()
    hold()
    batch.values[1] = batch.values[1].clone()
    hold()
    decoder.refresh()
    hold()
    table.write(3, random_adapter(table, 64, seed=3, kinds=("q_proj",)))  # a higher rank: every stack anew
    hold()
    table.write(3, random_adapter(table, 4, seed=4, kinds=("q_proj",)))  # in place: nothing new
    hold()
    assert held[0] == held[1] and held[-1] == held[-2] and len(set(held)) == 4
    fresh = AdapterTable(model, slots=2)
    fresh.write(1, random_adapter(fresh, 8, seed=5, kinds=("q_proj",)))
    graphs = DecodeGraphs(decoder, batch, fresh)
    held = []
    hold()
    fresh.write(2, random_adapter(fresh, 8, seed=6, kinds=("k_proj",)))  # a layer no adapter adapted yet
    hold()
    assert held[0] != held[1]


def test_ropes_that_grow_with_the_sequence_are_not_captured():
    """A dynamic rope reads the position back to the host to recompute its frequencies, which a
    capture may not do: no graphs for it (the decoder steps eagerly); a plain rope gets them."""
    def llama(rope_scaling: dict | None) -> torch.nn.Module:
        config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, rope_scaling=rope_scaling)
        return LlamaForCausalLM(config).eval()

    for rope_scaling, captured in (({"rope_type": "dynamic", "factor": 2.0}, False), (None, True)):
        model = llama(rope_scaling)
        graphs = DecodeGraphs.build(Decoder.build(model, 2), KVBatch(model, 2), AdapterTable(model, 1))
        assert (graphs is not None) == captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
def test_a_capture_that_fails_leaves_the_engine_stepping_eagerly(tiny_path, monkeypatch):
    """A capture that raises is logged, its step runs eagerly with the right logits, later steps
    are eager (not captured again each step), and the engine's thread is back on its stream."""
    model = load_model(tiny_path)[0].to("cuda")
    decoder = Decoder.build(model, 4)
    eager, ours = KVBatch(model, 4), KVBatch(model, 4)
    graphs = DecodeGraphs(decoder, ours, AdapterTable(model, 1))

    def refuse(*args, **kwargs):
        raise RuntimeError("no capture here")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    with torch.inference_mode():
        prefill = eager.prefill(model, [[5, 6, 7], [8, 9]], pad_id=0)
        eager.add(prefill)
        ours.add(prefill)
        tokens = prefill.logits.argmax(-1)
        for _ in range(3):
            expected = eager.step(model, tokens, decoder)
            got = ours.step(model, tokens, decoder, None, graphs)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
            tokens = expected.argmax(-1)
    assert "no capture here" in graphs.failed and not graphs.serves(None) and graphs.captures == 0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
