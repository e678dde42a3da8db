"""The trainer on the real tiny model: a step moves probability toward rewarded sampled tokens;
the train loop filters stale samples, publishes weights and announces versions."""

import asyncio
import json
import math

import pytest
import torch

from flywheel.bus import (
    SAMPLE_SUBJECT,
    TRAJECTORY_SUBJECT,
    WEIGHTS_SUBJECT,
    Sample,
    encode,
)
from flywheel.bus.records import sample_digest
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.train.advantages import RunningBaseline, group_advantages
from flywheel.train.loop import TrainLoop
from flywheel.train.packing import micro_batches
from flywheel.train.trainer import Trainer

from factories import rows_of, sample_of, sampled_turns
from waiting import until


async def referring_sample(bus, turn, reward: float, version: int) -> Sample:
    """A sample as the judge publishes it: its trajectory on TRAJECTORIES, referred to by sequence."""
    trajectory = sample_of(turn, reward, version).trajectory
    ack = await bus.js.publish(TRAJECTORY_SUBJECT, encode(trajectory), headers={"Nats-Msg-Id": f"{trajectory.id}-{version}"})
    return Sample(id=trajectory.id, trajectory_seq=ack.seq, reward=reward, judge="rule", consent=True)


async def test_a_step_raises_rewarded_and_lowers_unrewarded_sequences():
    turns = await sampled_turns(2)
    samples = [sample_of(turns[0], 1.0), sample_of(turns[1], 0.0)]
    model, tokenizer = load_model("tiny")
    config = load_config(None, ["actor.optimizer.lr=0.01"])
    trainer = Trainer(model, config.actor, config.train)
    advantages = group_advantages([1.0, 0.0], ["task", "task"], RunningBaseline())
    batches = micro_batches(rows_of(samples, advantages), budget=4096, pad_id=tokenizer.pad_token_id, packing=False)
    [batch] = batches
    # Engine logprobs are the behaviour policy: they match the trainer's own before any step.
    with torch.no_grad():
        before = trainer.token_logprobs(batch).logp
    mask = batch.loss_mask.bool()
    assert before[mask].tolist() == pytest.approx(batch.behav_logp[mask].tolist(), abs=2e-4)
    metrics = trainer.step([batches])
    with torch.no_grad():
        after = trainer.token_logprobs(batch).logp
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    assert gain[0] > 0 > gain[1]
    assert metrics["tokens"] == int(batch.loss_mask.sum()) and math.isfinite(metrics["loss"])
    assert metrics["behav_weight_max"] == pytest.approx(1.0, abs=1e-3)


async def test_train_loop_publishes_versions_and_drops_stale_samples(bus, nats_url, tmp_path):
    turns = await sampled_turns(4)
    config = load_config(None, [f"run_dir={tmp_path}", "train.batch_size=2", "rollout.max_head_offpolicyness=0"])
    loop = TrainLoop(config, nats_url)
    await loop.start()
    announcements = bus.follow(WEIGHTS_SUBJECT, from_last=False)
    try:
        await bus.publish(SAMPLE_SUBJECT, Sample(id="gone", trajectory_seq=10**6, reward=1.0, judge="rule", consent=True))
        await bus.publish(SAMPLE_SUBJECT, await referring_sample(bus, turns[0], 1.0, version=0))
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[1], 0.0, version=0))
        first = await asyncio.wait_for(anext(announcements), 60)
        assert first.version == 1 and (tmp_path / "weights" / "v1" / "model.safetensors").exists()
        # Version 0 samples are now one version behind: with eta = 0 they must not be trained on.
        for i in (2, 3):
            await bus.publish(SAMPLE_SUBJECT, await referring_sample(bus, turns[i], 1.0, version=0))
        for i, reward in ((2, 1.0), (3, 0.5)):
            await bus.publish(SAMPLE_SUBJECT, sample_of(turns[i], reward, version=1))
        second = await asyncio.wait_for(anext(announcements), 60)
        assert second.version == 2
        # Each announcement says where it comes from: its parent, the steps and samples since, their metrics.
        assert (first.parent, second.parent) == (0, 1)
        assert second.trained_on["steps"] == [2, 2] and second.trained_on["samples"] == 2
        assert len(set(first.trained_on["sample_digests"]) | set(second.trained_on["sample_digests"])) == 4
        assert second.metrics["reward_mean"] == 0.75 and "entropy" in second.metrics and second.metrics["reply_tokens"] > 0
        assert second.config["train"]["batch_size"] == 2
        assert loop.stats()["stale_dropped"] == 2 and loop.stats()["samples"] == 4
        assert loop.stats()["unresolved"] == 1  # its trajectory is not on the bus: counted, not trained
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2]
        for key in ("version", "reward_mean", "staleness_max", "n_samples", "loss", "elapsed_s"):
            assert key in lines[0]
        assert lines[0]["reward_mean"] == 0.5 and lines[1]["reward_mean"] == 0.75
        assert all(line["staleness_max"] == 0 for line in lines)
    finally:
        await announcements.aclose()
        await loop.stop()


async def test_the_trainer_refuses_a_sample_without_consent_put_on_the_bus_by_hand(bus, nats_url, tmp_path):
    """A sample that does not carry consent (or whose trajectory does not) is never trained:
    counted and terminated, while a consented one beside it is."""
    turns = await sampled_turns(3)
    config = load_config(None, [f"run_dir={tmp_path}", "train.batch_size=1", "rollout.max_head_offpolicyness=4"])
    loop = TrainLoop(config, nats_url)
    await loop.start()
    announcements = bus.follow(WEIGHTS_SUBJECT, from_last=False)
    try:
        unconsented = sample_of(turns[0], 1.0, version=0)
        unconsented.consent = False
        trajectory_not = sample_of(turns[1], 1.0, version=0)
        trajectory_not.trajectory.consent = False
        await bus.publish(SAMPLE_SUBJECT, unconsented)
        await bus.publish(SAMPLE_SUBJECT, trajectory_not)
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[2], 1.0, version=0))
        first = await asyncio.wait_for(anext(announcements), 60)
        await until(lambda: loop.counts["refused_no_consent"] == 2)
        assert first.trained_on["sample_digests"] == [sample_digest(sample_of(turns[2], 1.0, version=0).id)]
        assert loop.counts["samples"] == 1
    finally:
        await loop.stop()
