"""Checkpoints and `train.resume`: weights, optimizer, schedule, step, version, counters,
baseline and RNG come back; training goes on from there; a trainer that starts again without a
checkpoint marks the dead process's steps as leading nowhere."""

import json
import os
import subprocess
import sys

import pytest
import torch

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT
from flywheel.config import ConfigError, load_config
from flywheel.train.ledger import Ledger, lineage
from flywheel.train.loop import TrainLoop

from factories import sample_of, sampled_turns
from waiting import until


async def wait_for_version(loop: TrainLoop, version: int) -> None:
    # the step's bookkeeping done too
    await until(lambda: loop.last_metrics.get("version", 0) >= version and not loop.buffer, timeout_s=30)


async def test_resume_restores_the_whole_training_state(bus, nats_url, tmp_path):
    turns = await sampled_turns(6)
    overrides = [f"run_dir={tmp_path}", "train.batch_size=2", "train.checkpoint_interval=1", "rollout.max_head_offpolicyness=8",
                 "actor.optimizer.lr_schedule=linear", "train.max_steps=10"]
    first = TrainLoop(load_config(None, overrides), nats_url)
    await first.start()
    for i, reward in enumerate([1.0, 0.0, 0.5, 0.25]):
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[i], reward, version=0))
    await wait_for_version(first, 2)
    saved_optimizer = {k: v.clone() for k, v in first.trainer.optimizer.state[next(first.trainer.model.parameters())].items()}
    saved = {"lr": first.trainer.scheduler.get_last_lr(), "baseline": first.baseline.value, "counts": dict(first.counts),
             "staleness": dict(first.staleness_seen)}
    await first.stop()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]

    torch.manual_seed(999)
    second = TrainLoop(load_config(None, [*overrides, "train.resume=true"]), nats_url)
    await second.start()
    try:
        assert second.version == 2 and second.trainer.step_count == 2
        assert second.trainer.scheduler.get_last_lr() == saved["lr"]
        assert second.baseline.value == saved["baseline"] and second.counts == saved["counts"]
        assert dict(second.staleness_seen) == saved["staleness"]
        state = second.trainer.optimizer.state[next(second.trainer.model.parameters())]
        assert all(torch.equal(state[k], v) for k, v in saved_optimizer.items())
        checkpoint = torch.load(tmp_path / "checkpoints" / "step-00000002" / "state.pt", weights_only=False)
        assert torch.equal(torch.get_rng_state(), checkpoint["rng"]["torch"])
        assert (await bus.last(WEIGHTS_SUBJECT)).version == 2  # what serving already has
        for i, reward in ((4, 1.0), (5, 0.0)):
            await bus.publish(SAMPLE_SUBJECT, sample_of(turns[i], reward, version=2))
        await wait_for_version(second, 3)
    finally:
        await second.stop()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


async def test_resume_without_a_checkpoint_is_a_config_error(nats_url, tmp_path):
    loop = TrainLoop(load_config(None, [f"run_dir={tmp_path}", "train.resume=true"]), nats_url)
    with pytest.raises(ConfigError, match="train.resume: no checkpoint"):
        await loop.start()
    # The refused trainer let go of the run directory: another process takes its lock at once.
    take = "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'a'), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    assert subprocess.run([sys.executable, "-c", take, str(tmp_path / "train.lock")]).returncode == 0
    # ... and holds none of its files open (the ledger was), while the loop object lives on.
    open_here = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    assert {str(path.resolve()) for path in tmp_path.rglob("*")} & open_here == set(), loop


async def test_a_trainer_that_died_before_its_first_checkpoint_leaves_no_steps_in_the_lineage(bus, nats_url, tmp_path):
    """A trainer killed before it saved a checkpoint starts again from the initial weights: the
    steps the dead process logged in `trained.jsonl` made weights that lead nowhere, and their
    samples (never acknowledged) are trained again. The fault drill counted them as trained twice
    when the kill came before the first checkpoint."""
    Ledger(tmp_path / "trained.jsonl").trained(1, 1, ["s0", "s1"])  # what the dead process logged
    turns = await sampled_turns(2)
    loop = TrainLoop(load_config(None, [f"run_dir={tmp_path}", "train.batch_size=2", "rollout.max_head_offpolicyness=8"]),
                     nats_url)
    await loop.start()
    try:
        assert lineage(tmp_path / "trained.jsonl") == []  # started from the initial weights
        for turn in turns:
            await bus.publish(SAMPLE_SUBJECT, sample_of(turn, 1.0, version=0))
        await wait_for_version(loop, 1)
    finally:
        await loop.stop()
    [step] = lineage(tmp_path / "trained.jsonl")
    assert step["step"] == 1 and len(step["samples"]) == 2


def test_weights_back_at_an_earlier_version_leave_the_later_steps_out_of_the_lineage(tmp_path):
    """An adapter's way back leaves the other adapters' steps, and its own steps after, alone."""
    ledger = Ledger(tmp_path / "trained.jsonl")
    for step, adapter, version in [(1, "alice", 1), (1, "bob", 1), (2, "alice", 2), (3, "alice", 3)]:
        ledger.trained(step, version, [f"{adapter}-{version}"], adapter=adapter)
    ledger.back_to(1, adapter="alice")  # v2 and v3 rejected
    ledger.trained(4, 4, ["alice-4"], adapter="alice")
    ledger.close()
    assert [s["samples"] for s in lineage(tmp_path / "trained.jsonl")] == [["alice-1"], ["bob-1"], ["alice-4"]]
