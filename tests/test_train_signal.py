"""The trainer's numbers match the engine's: each token recomputed at the temperature it was
sampled at (`behav_logprob_gap` ≈ 0), untrainable turns excluded and counted, whole task
groups per step, every sample trained once (across restarts too), and a PPO clip that fires."""

import asyncio
import json
import time
from collections import Counter

import msgspec
import pytest
import torch

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, Sample, encode
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.train.loop import TrainLoop
from flywheel.train.packing import Row, micro_batches, split_minibatches
from flywheel.train.trainable_tokens import segment_sampling
from flywheel.train.trainer import Trainer

from factories import sample_of, sampled_turns
from waiting import until


def lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grouped(turn, task: str, size: int):
    return msgspec.structs.replace(turn, task_id=task, group_size=size)


async def test_logprobs_are_recomputed_at_the_temperature_each_turn_was_sampled_at():
    turns = await sampled_turns(4, temperature=0.7)
    model, _ = load_model("tiny")
    trainer = Trainer(model, load_config(None, []).actor, load_config(None, []).train)
    rows = []
    for turn in turns:
        trajectory = sample_of(turn, 1.0).trajectory
        [sampling] = segment_sampling(trajectory, Counter())
        rows.append(Row(trajectory.segments[0], [1.0] * len(turn.prompt_ids + turn.output_ids), sampling.temperatures))
    [batch] = micro_batches(rows, budget=10_000, pad_id=0)
    with torch.no_grad():
        logp = trainer.token_logprobs(batch).logp
    mask = batch.loss_mask.bool()
    assert logp[mask].tolist() == pytest.approx(batch.behav_logp[mask].tolist(), abs=2e-4)


async def one_step(bus, nats_url, tmp_path, turns) -> dict:
    """The metrics line of a train loop's one step on `turns` (version 0, rewards 0 and 1)."""
    loop = TrainLoop(load_config(None, [f"run_dir={tmp_path}", f"train.batch_size={len(turns)}",
                                        "rollout.max_head_offpolicyness=0"]), nats_url)
    await loop.start()
    try:
        for i, turn in enumerate(turns):
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, float(i % 2), version=0))
        await until(lambda: loop.trainer.step_count == 1)
    finally:
        await loop.stop()
    [line] = lines(tmp_path)
    return line


async def test_the_step_metrics_show_a_zero_gap_at_temperature_0_7(bus, nats_url, tmp_path):
    turns = await sampled_turns(4, temperature=0.7)
    line = await one_step(bus, nats_url, tmp_path, turns)
    assert line["gap_tokens"] == sum(len(t.output_ids) for t in turns)
    assert line["behav_logprob_gap"] < 1e-4  # float noise: the engine's distribution, reproduced


async def test_greedy_truncated_and_constrained_tokens_leave_the_loss_and_are_counted(bus, nats_url, tmp_path):
    turns = await sampled_turns(4)
    samplings = [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0, "min_new_tokens": 2}, {"temperature": 1.0}]
    turns = [msgspec.structs.replace(t, sampling=s) for t, s in zip(turns, samplings)]
    line = await one_step(bus, nats_url, tmp_path, turns)
    n = [len(t.output_ids) for t in turns]
    assert line["excluded_tokens"] == {"greedy": n[0], "truncated": n[1], "constrained": 2}
    assert line["tokens"] == n[2] - 2 + n[3]


async def test_several_minibatches_make_the_clip_fire():
    turns = await sampled_turns(8)
    samples = [sample_of(t, float(i % 2)) for i, t in enumerate(turns)]
    clip = {}
    for n in (1, 4):
        config = load_config(None, ["actor.optimizer.lr=0.05", f"actor.ppo_n_minibatches={n}"])
        trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
        rows = [[Row(seg, [1.0 - 2 * (i % 2)] * len(seg.token_ids))] for i, s in enumerate(samples) for seg in s.trajectory.segments]
        minibatches = [micro_batches(rs, 10_000, 0) for rs in split_minibatches(rows, n)]
        metrics = trainer.step(minibatches, version=0)
        assert metrics["minibatches"] == n
        clip[n] = metrics["clip_fraction"]
    assert clip[1] == 0.0 and clip[4] > 0.0  # one step: π_θ = π_prox throughout; then it moves away


async def test_each_epoch_passes_over_the_minibatches_again_against_the_same_proximal_policy():
    turns = await sampled_turns(8)
    samples = [sample_of(t, float(i % 2)) for i, t in enumerate(turns)]
    rows = [[Row(seg, [1.0 - 2 * (i % 2)] * len(seg.token_ids))] for i, s in enumerate(samples) for seg in s.trajectory.segments]
    metrics = {}
    for epochs in (1, 3):
        config = load_config(None, ["actor.optimizer.lr=0.05", "actor.ppo_n_minibatches=2", f"actor.ppo_epochs={epochs}"])
        trainer = Trainer(load_model("tiny")[0], config.actor, config.train)
        minibatches = [micro_batches(rs, 10_000, 0) for rs in split_minibatches(rows, 2)]
        metrics[epochs] = trainer.step(minibatches, version=0)
    assert [metrics[e]["optimizer_steps"] for e in (1, 3)] == [2, 6]
    assert metrics[1]["minibatches"] == metrics[3]["minibatches"] == 2
    assert metrics[3]["clip_fraction"] > metrics[1]["clip_fraction"]  # later passes move further from π_prox


async def test_a_step_takes_whole_groups(bus, nats_url, tmp_path):
    turns = await sampled_turns(8)
    a = [grouped(t, "a", 4) for t in turns[:4]]
    b = [grouped(t, "b", 4) for t in turns[4:]]
    loop = TrainLoop(load_config(None, [f"run_dir={tmp_path}", "train.batch_size=4", "rollout.max_head_offpolicyness=4"]), nats_url)
    await loop.start()
    try:
        for turn in a[:2]:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 1.0))
        for turn in b:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 0.25))
        await until(lambda: loop.trainer.step_count == 1)
        for turn in a[2:]:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 0.0))
        await until(lambda: loop.trainer.step_count == 2)
    finally:
        await loop.stop()
    first, second = lines(tmp_path)
    assert first["reward_mean"] == 0.25 and first["n_groups"] == 1  # b, whole; not a's first two and half of b
    assert second["reward_mean"] == 0.5 and second["n_samples"] == 4
    assert first["groups_split"] == second["groups_split"] == 0


async def test_a_redelivered_sample_is_never_trained_twice_even_after_a_restart(bus, nats_url, tmp_path):
    turns = await sampled_turns(3)
    overrides = [f"run_dir={tmp_path}", "train.batch_size=1", "rollout.max_head_offpolicyness=8"]
    first = TrainLoop(load_config(None, overrides), nats_url)
    await first.start()

    async def redeliver(sample: Sample, copy: int) -> None:  # as the bus does past its duplicate window
        await bus.js.publish(SAMPLE_SUBJECT, encode(sample), headers={"Nats-Msg-Id": f"{sample.id}/copy-{copy}"})

    samples = [sample_of(t, 1.0) for t in turns]
    try:
        await bus.publish(SAMPLE_SUBJECT, samples[0])
        await until(lambda: first.trainer.step_count == 1)
        await redeliver(samples[0], 1)
        await bus.publish(SAMPLE_SUBJECT, samples[1])
        await until(lambda: first.trainer.step_count == 2)
        assert first.counts["duplicates_dropped"] == 1
    finally:
        await first.stop()
    second = TrainLoop(load_config(None, overrides), nats_url)
    await second.start()
    try:
        await redeliver(samples[0], 2)
        await redeliver(samples[1], 2)
        await bus.publish(SAMPLE_SUBJECT, samples[2])
        await until(lambda: second.trainer.step_count == 3)
        await until(lambda: second.counts["duplicates_dropped"] == 3)
    finally:
        await second.stop()
    assert [line["step"] for line in lines(tmp_path)] == [1, 2, 3]
    assert lines(tmp_path)[-1]["duplicates_dropped"] == 3


async def test_a_restart_behind_published_versions_announces_a_newer_one(bus, nats_url, tmp_path):
    turns = await sampled_turns(3)
    overrides = [f"run_dir={tmp_path}", "train.batch_size=1", "train.checkpoint_interval=1", "rollout.max_head_offpolicyness=8"]
    first = TrainLoop(load_config(None, overrides), nats_url)
    await first.start()
    try:
        for turn in turns[:2]:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 1.0))
        await until(lambda: first.trainer.step_count == 2)
    finally:
        await first.stop()
    # As if the trainer had died after publishing version 3 and before checkpointing it.
    first.publisher.store.publish(first.trainer.model, 3)
    second = TrainLoop(load_config(None, [*overrides, "train.resume=true"]), nats_url)
    await second.start()
    try:
        announced = await bus.last(WEIGHTS_SUBJECT)
        assert second.trainer.step_count == 2 and second.version == 4 and announced.version == 4  # serve takes only newer
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[2], 1.0, version=4))
        # The step is counted before its weights are announced: wait for the announcement itself.
        await until(lambda: announced_version(bus, 5))
    finally:
        await second.stop()


async def test_samples_are_kept_from_redelivery_while_their_step_outlasts_the_ack_wait(bus, nats_url, tmp_path):
    """A step slower than the ack wait (SmolLM2's take ~35 s against 30 s) must not have its
    samples delivered again meanwhile. A burst of 240 samples, and a step made two and a half
    ack waits slower than it is: with the step's own time against a 1 s ack wait, two fresh
    clones on a loaded host saw 227 of the 240 delivered again (cause not found; odd things 14, 16)."""
    [turn] = await sampled_turns(1)
    samples = [sample_of(msgspec.structs.replace(turn, session_id=f"s{i}"), float(i % 2)) for i in range(240)]
    overrides = [f"run_dir={tmp_path}", "bus.ack_wait_s=2", "train.batch_size=240", "train.micro_batch_tokens=16"]
    loop = TrainLoop(load_config(None, overrides), nats_url)
    await loop.start()
    train = loop._train

    def slow_train(groups):
        time.sleep(5.0)
        return train(groups)

    loop._train = slow_train
    try:
        for sample in samples:
            await bus.publish(SAMPLE_SUBJECT, sample)
        # The step's metrics line, not its count: the count goes up inside the step, the line after it.
        await until(lambda: (tmp_path / "metrics.jsonl").exists() and lines(tmp_path))
        # A sleep, not a wait: that nothing comes is the claim. Two more ack waits, the loop
        # fetching all along: a redelivery would be in by then.
        await asyncio.sleep(4.5)
        info = await bus.js.consumer_info("SAMPLES", "train")
        assert (info.delivered.consumer_seq, loop.counts["duplicates_dropped"]) == (240, 0), (info, lines(tmp_path))
    finally:
        await loop.stop()


async def test_samples_are_kept_from_redelivery_while_their_trajectories_are_looked_up(bus, nats_url, tmp_path):
    """Between a fetch and the batcher the trainer looks each sample's trajectory up on the bus:
    lookups slower than the ack wait (a loaded bus) must not have the samples delivered again."""
    turns = await sampled_turns(4)
    overrides = [f"run_dir={tmp_path}", "bus.ack_wait_s=1", "train.batch_size=4"]
    loop = TrainLoop(load_config(None, overrides), nats_url)
    await loop.start()
    resolve = loop.bus.resolve

    async def slow_resolve(record):
        await asyncio.sleep(2.5)  # two and a half ack waits
        return await resolve(record)

    loop.bus.resolve = slow_resolve
    try:
        for turn in turns:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 1.0))
        await until(lambda: (tmp_path / "metrics.jsonl").exists() and lines(tmp_path))
        await asyncio.sleep(2.5)  # as above: a redelivery would be in by then
        info = await bus.js.consumer_info("SAMPLES", "train")
        assert info.delivered.consumer_seq == 4 and loop.counts["duplicates_dropped"] == 0
    finally:
        await loop.stop()


async def announced_version(bus, version: int) -> bool:
    """Whether the newest weights announcement is `version`."""
    return (await bus.last(WEIGHTS_SUBJECT)).version == version
