"""The GPU path on the real tiny model, where a CUDA device exists (skipped elsewhere: the suite
never needs a GPU): the engine on CUDA records, for rows joining, leaving and outgrowing the KV
cache, the log-probs the model's own forward pass on CUDA gives; a bfloat16 engine stays near
the float32 model; and the loop's GPU round trip works: the engine's samples trained on CUDA
(bf16 autocast) with a small `behav_logprob_gap`, the weights published and swapped into the
CUDA engine, which then samples what the trained model scores."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from flywheel.bus import Segment
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model, load_weights, place
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.train.packing import Row, micro_batches
from flywheel.train.trainer import Trainer

from factories import prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


def forward_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log softmax of the model's own logits at each output token, one sequence alone."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt_ids):, None]).squeeze(1).tolist()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(["add", "seven", "to", "the", "number", "please"]) for _ in range(rng.randint(1, 40)))
            for _ in range(n)]


async def generate(engine: Engine, tokenizer, lengths: list[int], seed: int) -> list:
    return await asyncio.gather(*(
        engine.generate(prompt(tokenizer, text), SamplingParams(max_new_tokens=n, ignore_eos=True, sampling_seed=i))
        for i, (text, n) in enumerate(zip(texts(len(lengths), seed), lengths))))


def training_rows(results) -> list[Row]:
    """Each engine answer as a training row with the engine's log-probs, advantages ±1 in turn."""
    rows = []
    for i, r in enumerate(results):
        p, o = len(r.prompt_ids), len(r.output_ids)
        segment = Segment(token_ids=r.prompt_ids + r.output_ids, loss_mask=[0] * p + [1] * o,
                          logprobs=[0.0] * p + list(r.logprobs), versions=[-1] * p + [0] * o)
        rows.append(Row(segment, [0.0] * p + [1.0 if i % 2 else -1.0] * o))
    return rows


def cuda_trainer(tiny_path, *overrides: str) -> Trainer:
    config = load_config(None, ["train.device=cuda", "actor.ppo_n_minibatches=1", "actor.optimizer.lr=0.001", *overrides])
    return Trainer(load_model(tiny_path)[0], config.actor, config.train)


async def test_the_engine_on_cuda_records_what_its_own_forward_pass_gives(tiny_path):
    model, tokenizer = load_model(tiny_path)
    model = place(model, "cuda")
    engine = Engine(model, tokenizer, max_batch_size=4).start()
    try:
        lengths = [300, 5, 40, 9, 70, 3, 25, 60, 12]  # one row outgrows the first 256 columns
        results = await generate(engine, tokenizer, lengths, seed=5)
        assert engine.load()["cached_tokens"] == 0
    finally:
        engine.stop()
    for result, n in zip(results, lengths):
        assert len(result.output_ids) == n
        assert result.logprobs == pytest.approx(forward_logprobs(model, result.prompt_ids, result.output_ids), abs=2e-4)


async def test_a_bfloat16_engine_on_cuda_stays_near_the_float32_model(tiny_path):
    reference, tokenizer = load_model(tiny_path)
    reference = place(reference, "cuda")
    model, _ = load_model(tiny_path, torch.bfloat16)
    engine = Engine(place(model, "cuda"), tokenizer, max_batch_size=4).start()
    try:
        results = await generate(engine, tokenizer, [32, 8, 64, 16], seed=7)
    finally:
        engine.stop()
    gaps = [abs(a - b) for r in results for a, b in zip(r.logprobs, forward_logprobs(reference, r.prompt_ids, r.output_ids))]
    assert len(gaps) == 120 and sum(gaps) / len(gaps) < 0.05


async def test_samples_trained_on_cuda_then_swapped_into_the_cuda_engine(tiny_path, tmp_path):
    model, tokenizer = load_model(tiny_path)
    engine = Engine(place(model, "cuda"), tokenizer, max_batch_size=8, load_weights=load_weights).start()
    try:
        results = await generate(engine, tokenizer, [24, 8, 48, 16, 32, 12], seed=9)
        trainer = cuda_trainer(tiny_path)
        metrics = trainer.step([micro_batches(training_rows(results), 4096, pad_id=0)], version=0)
        assert metrics["gap_tokens"] == 140 and metrics["behav_logprob_gap"] < 0.02  # bf16 autocast against fp32
        assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
        path = WeightStore(tmp_path / "weights").publish(trainer.model, 1, tokenizer)
        await engine.update_weights(str(path), "1")
        after = await generate(engine, tokenizer, [20, 40], seed=11)
    finally:
        engine.stop()
    changed = dict(trainer.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"], changed.detach())
    for result in after:
        assert result.versions == ["1"] * len(result.output_ids)
        expected = forward_logprobs(trainer.model.eval(), result.prompt_ids, result.output_ids)
        assert result.logprobs == pytest.approx(expected, abs=2e-4)


async def test_without_autocast_the_trainer_on_cuda_reproduces_the_engine(tiny_path):
    model, tokenizer = load_model(tiny_path)
    engine = Engine(place(model, "cuda"), tokenizer, max_batch_size=8).start()
    try:
        results = await generate(engine, tokenizer, [24, 8, 48, 16, 32, 12], seed=13)
    finally:
        engine.stop()
    gaps = {}
    for autocast in ("true", "false"):
        trainer = cuda_trainer(tiny_path, f"train.autocast={autocast}")
        metrics = trainer.step([micro_batches(training_rows(results), 4096, pad_id=0)], version=0)
        assert metrics["gap_tokens"] == 140
        gaps[autocast] = metrics["behav_logprob_gap"]
    assert gaps["false"] < 1e-5 < gaps["true"], gaps  # float32 reproduces the engine; bf16 rounds (H200: 1.7e-7, 9.7e-4)
