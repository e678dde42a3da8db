"""The engine's own decode step (`flywheel/serve/engine/decoder.py`) against the owner of the numbers,
transformers' forward pass: the same logits over the same KV cache, for the architectures it
implements (Qwen2 with its biases: tiny; Llama with tied embeddings, grouped KV heads and a
scaled rope), and transformers' forward kept for those it does not."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flywheel.models import load_model
from flywheel.serve.engine.decoder import Decoder
from flywheel.serve.engine.kv_cache import KVBatch


def small_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    return LlamaForCausalLM(config).eval()


def decode_both_ways(model, sequences: list[list[int]], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill `sequences`, then `steps` decode steps of the same tokens through two batches:
    transformers' forward over the whole batch, and the decoder's in spans of 2 slots. The first
    row leaves half-way (the last row's cache moves into its slot). Pairs of logits, in the
    reference's row order."""
    decoder = Decoder.build(model, len(sequences))
    assert decoder is not None
    reference = KVBatch(model, len(sequences), first_columns=16)
    ours = KVBatch(model, len(sequences), first_columns=16, attention_rows=2)
    where = list(range(len(sequences)))  # ours' row i is the reference's row where[i]
    pairs = []
    with torch.inference_mode():
        prefill = reference.prefill(model, sequences, pad_id=0)
        reference.add(prefill)
        ours.add(prefill)
        tokens = prefill.logits.argmax(-1)
        for step in range(steps):
            if step == steps // 2:
                kept = reference.retain(list(range(1, reference.rows)))
                order = ours.retain([i for i, row in enumerate(where) if row != 0])
                where = [kept.index(where[i]) for i in order]
                tokens = tokens[kept]
            inverse = [where.index(row) for row in range(len(where))]
            expected = reference.step(model, tokens)
            got = ours.step(model, tokens[where], decoder)[inverse]
            pairs.append((expected.float(), got))
            tokens = expected.argmax(-1)
    assert ours.lengths[where.index(0)] == reference.lengths[0]
    return pairs


ROUNDING = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Logits within float rounding: float32's, and two bfloat16 steps at these models' logits (~1)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", ["tiny", "llama"])
def test_decode_steps_give_transformers_logits(which, dtype, tiny_path):
    """Rows of different lengths, one outgrowing the first 16 columns (the cache doubles), one
    leaving, attention in spans (over strided slices of the cache): every step's logits equal
    transformers' to float rounding, in float32 and in bfloat16."""
    model = (load_model(tiny_path)[0] if which == "tiny" else small_llama()).to(dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (30, 1, 29, 2, 28, 3)]
    for expected, got in decode_both_ways(model, sequences, steps=20):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert torch.allclose(got, expected, atol=ROUNDING[dtype], rtol=0), (got - expected).abs().max()


def test_refresh_follows_new_weights(tiny_path):
    """The decoder's weights are a copy: after the model's weights change, steps use the old
    ones until `refresh()`, then the new ones (the engine refreshes after each weight update)."""
    model = load_model(tiny_path)[0]
    decoder = Decoder.build(model, 2)
    batch = KVBatch(model, 2, first_columns=16)
    with torch.inference_mode():
        batch.add(batch.prefill(model, [[5, 6, 7], [8, 9]], pad_id=0))
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        tokens = torch.tensor([10, 11])
        stale = batch.step(model, tokens, decoder)
        batch.lengths -= 1  # the same step again
        decoder.refresh()
        fresh = batch.step(model, tokens, decoder)
        batch.lengths -= 1
        expected = batch.step(model, tokens).float()
    assert not torch.allclose(stale, expected, atol=1e-3)
    assert torch.allclose(fresh, expected, atol=1e-4, rtol=1e-4)


def test_architectures_it_does_not_implement_keep_transformers_forward():
    sliding = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert Decoder.build(Qwen2ForCausalLM(sliding), 4) is None
    assert Decoder.build(small_llama(), 4) is not None
