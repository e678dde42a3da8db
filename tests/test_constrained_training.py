"""Tokens drawn under a grammar (forced tool calls, `response_format`) are trained under the same
mask: served by the real gateway, stitched by the real collector, one step of the real trainer
reproduces their behaviour log-probabilities (`behav_logprob_gap` ≈ 0) where the whole vocabulary
does not, and they count in the loss; a turn whose grammar cannot be replayed leaves the loss,
counted."""

import asyncio
import math
from collections import Counter

import msgspec
import torch

from flywheel.bus import TRAJECTORY_SUBJECT, Sample, Trajectory
from flywheel.config import load_config
from flywheel.formats.grammar import TokenGrammar, allowed_tokens, model_grammar
from flywheel.models import load_model
from flywheel.serve.engine.core import Engine
from flywheel.serve.engine.sampling import SamplingParams
from flywheel.train.packing import Row, micro_batches
from flywheel.train.trainer import GapStats, Trainer

from bus_reading import read
from factories import ASK_FORECAST, FORECAST, FORECAST_TOOLS, make_turn, platform, post_feedback, sample_of, step_of

AGENTS = {  # every turn of each session is drawn under a grammar
    "named": {"tools": FORECAST_TOOLS, "tool_choice": {"type": "function", "function": {"name": "forecast"}}},
    "required": {"tools": FORECAST_TOOLS, "tool_choice": "required"},
    "shaped": {"response_format": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}},
}


async def agent(serve, client, session: str, reward: float, **kw) -> None:
    """Two turns, as an agent sends them (the whole history each time), then a reward."""
    messages = list(ASK_FORECAST)
    for seed in range(2):
        reply = await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=40, seed=seed,
                                                     extra_headers={"X-Session-Id": session}, **kw)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls]
        else:
            messages.append({"role": "user", "content": "And in Rome?"})
    await post_feedback(serve, session, reward)


async def test_forced_calls_and_response_formats_are_trained_under_their_grammar(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path) as (serve, _, client):
        await asyncio.gather(*(agent(serve, client, name, float(i), **kw) for i, (name, kw) in enumerate(AGENTS.items())))
        trajectories = await read(bus, TRAJECTORY_SUBJECT, "constrained", len(AGENTS), lambda r: isinstance(r, Trajectory))
    assert sorted(t.session_id for t in trajectories) == sorted(AGENTS)
    assert all(len(t.turns) == 2 and any(k in turn.sampling for k in ("ebnf", "json_schema"))
               for t in trajectories for turn in t.turns)
    samples = [Sample(id=t.id, trajectory=t, reward=float(i), judge="rule") for i, t in enumerate(trajectories)]
    sampled = sum(sum(seg.loss_mask) for t in trajectories for seg in t.segments)
    forced = sum(lp == 0.0 for t in trajectories for seg in t.segments for lp, m in zip(seg.logprobs, seg.loss_mask) if m)
    assert forced > 10  # the grammar left a single token: drawn with probability 1

    config = load_config(None, ["actor.ppo_n_minibatches=1"])
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
    batch = step_of(samples, config)
    [whole] = micro_batches(unmasked_rows(samples), budget=100_000, pad_id=0)
    with torch.no_grad():
        vocabulary_wide = trainer.token_logprobs(whole).logp
    old = GapStats()
    old.add(vocabulary_wide, whole, version=0)
    assert old.tokens == sampled and old.mean > 0.5  # over the whole vocabulary: not what the engine sampled from

    metrics = trainer.step(batch.minibatches, version=0)
    assert batch.excluded == Counter()
    assert metrics["gap_tokens"] == sampled and metrics["behav_logprob_gap"] < 1e-4
    assert metrics["tokens"] == sampled and metrics["grammar_tokens"] == sampled
    assert 0.0 < metrics["entropy"] < math.log(2048) / 2  # the masked distributions': a forced token's is 0


def unmasked_rows(samples: list[Sample]) -> list[Row]:
    """Rows without grammar masks (as the trainer built them before): each token over the whole
    vocabulary, at temperature 1 (the requests'), on the segments' own loss masks."""
    return [Row(seg, [0.0] * len(seg.token_ids)) for s in samples for seg in s.trajectory.segments]


async def regex_turns() -> list:
    """Three real turns of the engine drawn under `regex` [0-9]{3}."""
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer).start()
    try:
        params = [SamplingParams(max_new_tokens=8, sampling_seed=i, regex="[0-9]{3}") for i in range(3)]
        results = await asyncio.gather(*(engine.generate([1, 2, 3], p) for p in params))
    finally:
        engine.stop()
    return [make_turn(id=f"r{i}", session_id=f"r{i}", prompt_ids=r.prompt_ids, output_ids=r.output_ids,
                      output_logprobs=r.logprobs, output_versions=[0] * len(r.output_ids),
                      sampling={"temperature": 1.0, "regex": "[0-9]{3}"})
            for i, r in enumerate(results)]


async def test_a_grammar_that_cannot_be_replayed_leaves_the_loss_and_is_counted():
    kept, rejected, invalid = await regex_turns()
    rejected = msgspec.structs.replace(rejected, sampling={"temperature": 1.0, "regex": "[a-z]{3}"})
    invalid = msgspec.structs.replace(invalid, sampling={"temperature": 1.0, "ebnf": "start: ("})
    config = load_config(None, ["actor.ppo_n_minibatches=1"])
    batch = step_of([sample_of(t, 1.0) for t in (kept, rejected, invalid)], config)
    assert batch.excluded == Counter({"unreplayable_grammar": len(rejected.output_ids) + len(invalid.output_ids)})
    metrics = Trainer(load_model("tiny")[0], config.actor, config.train).step(batch.minibatches, version=0)
    assert metrics["tokens"] == metrics["grammar_tokens"] == len(kept.output_ids)
    assert metrics["behav_logprob_gap"] < 1e-4


def test_a_mask_covers_logits_wider_than_the_tokenizer():
    """A model's logits may outnumber its tokenizer's tokens: the tokens past it are never allowed."""
    tokenizer = model_grammar("tiny").hf_tokenizer
    n = len(tokenizer)
    grammar = TokenGrammar(tokenizer, n + 40, {tokenizer.eos_token_id})
    ids = tokenizer.encode("2024", add_special_tokens=False) + [tokenizer.eos_token_id]
    bitmask = grammar.replay("regex", "[0-9]+", ids)
    assert bitmask.shape == (len(ids), (n + 40 + 31) // 32)
    allowed = allowed_tokens(bitmask, n + 100)
    assert allowed[torch.arange(len(ids)), ids].all() and not allowed[:, n:].any()
    assert allowed[0].sum() < n / 2  # digits only
