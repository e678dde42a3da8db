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
    generator = torch.Generator().manual_seed(2)
    for slot, rank, kinds in ((1, 4, None), (2, 8, ("q_proj", "v_proj"))):
        layers = {name: (torch.randn(rank, layer.in_features, generator=generator) * 0.1,
                         torch.randn(layer.out_features, rank, generator=generator) * 0.1)
                  for name, layer in table.layers.items() if kinds is None or name.endswith(kinds)}
        table.write(slot, LoraAdapter(Path(f"slot{slot}"), layers))
    return table


@pytest.mark.parametrize("adapters", [True, False], ids=["adapters", "base"])
@DEVICES
def test_replayed_steps_give_the_eager_decoders_logits(device, adapters, tiny_path, monkeypatch):
    monkeypatch.setattr(lora_batch, "DENSE_COLUMNS", {"cpu": 8192, "cuda": 8192})
    model = load_model(tiny_path)[0].to(device)
    decoder = Decoder.build(model, 8)
    table = adapter_table(model)
    eager, ours = (KVBatch(model, 8, first_columns=32) for _ in range(2))
    graphs = DecodeGraphs(decoder, ours, table)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (26, 1, 25, 2, 24)]
    slots = [1, 0, 2, 1, 0] if adapters else [0] * 5
    steps, held = 16, []
    with torch.inference_mode():
        prefill = eager.prefill(model, sequences, pad_id=0)
        eager.add(prefill)
        ours.add(prefill)
        tokens = prefill.logits.argmax(-1)
        for step in range(steps):
            if step == 5:  # two rows leave: 3 rows, another bucket (4 instead of 8)
                order = eager.retain([0, 2, 4])
                assert ours.retain([0, 2, 4]) == order
                tokens, slots = tokens[order], [slots[i] for i in order]
            if step == 11:  # new weights: the decoder's fused copy is rebuilt, the graphs must follow
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
    assert eager.columns == 64 and len(set(held)) == 3  # the cache grew at 33 tokens, the weights changed
    for layer in range(eager.layer_count):
        for store in ("keys", "values"):
            for row, length in enumerate(eager.lengths.tolist()):
                torch.testing.assert_close(getattr(ours, store)[layer][row, :, :length],
                                           getattr(eager, store)[layer][row, :, :length], rtol=0, atol=1e-5)
    if device == "cuda":  # (bucket 8, then 4) x (the first cache, the grown one, the new weights), less unused pairs
        assert 3 <= graphs.captures <= 4


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
    layer = next(iter(table.layers))
    table.write(3, LoraAdapter(Path("wide"), {layer: (torch.zeros(64, table.layers[layer].in_features),
                                                      torch.zeros(table.layers[layer].out_features, 64))}))
    hold()
    assert held[0] == held[1] and len(set(held)) == 4
