"""The engine's batched sampler (`flywheel/serve/engine/sampling.py`): tokens drawn with the probabilities
the recorded behaviour log-probs claim, never a token that top-k or top-p removed, and a seeded
row's draw independent of the rows batched with it."""

from __future__ import annotations

import math

import torch

from flywheel.serve.engine.sampling import SamplingParams, sample

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])


def draws(rows: int, params: SamplingParams, seeded: bool) -> torch.Tensor:
    logits = PROBS.log().expand(rows, -1).clone()
    generators = [torch.Generator().manual_seed(i) if seeded else None for i in range(rows)]
    tokens, logprobs, _, failed = sample(logits, [params] * rows, generators)
    assert failed == []
    assert torch.allclose(logprobs, PROBS.log()[tokens])  # the behaviour log-prob of the drawn token
    return tokens


def test_draws_follow_the_distribution_seeded_or_not():
    torch.manual_seed(0)
    n = 20_000
    for seeded in (False, True):
        tokens = draws(n, SamplingParams(), seeded)
        counts = torch.bincount(tokens, minlength=len(PROBS)).double() / n
        for p, share in zip(PROBS.tolist(), counts.tolist()):
            assert abs(share - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (seeded, p, share)


def test_truncated_tokens_are_never_drawn():
    torch.manual_seed(1)
    assert set(draws(5_000, SamplingParams(top_k=2), seeded=True).tolist()) == {0, 1}
    assert set(draws(5_000, SamplingParams(top_p=0.7), seeded=False).tolist()) == {0, 1}
    assert set(draws(100, SamplingParams(top_p=1e-300), seeded=True).tolist()) == {0}


def test_a_seeded_row_draws_the_same_token_whatever_is_batched_with_it():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9) for _ in range(8)]
    together, _, _, _ = sample(logits, params, [torch.Generator().manual_seed(100 + i) for i in range(8)])
    for i in range(8):
        alone, _, _, _ = sample(logits[i:i + 1], params[i:i + 1], [torch.Generator().manual_seed(100 + i)])
        assert alone.item() == together[i].item()
