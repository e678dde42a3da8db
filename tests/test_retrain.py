"""`flywheel forget --retrain`: the trainer's weights rebuilt without a forgotten user's samples,
on a real bus after real loops trained on two users' traffic. The rebuilt weights are what the
trainer's own steps give on the remaining samples from the last checkpoint before the forgotten
user's first one; they replace the later checkpoints and lineage, are published as a new version
and audited; a trainer that starts again continues from them. While a trainer runs, the command
refuses before removing anything, and a second trainer refuses to share a run directory."""

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from flywheel.bus.records import sample_digest
from flywheel.bus.scan import stored_records
from flywheel.cli import command
from flywheel.config import ConfigError
from flywheel.models import load_model, load_weights
from flywheel.train.advantages import RunningBaseline
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.grouping import Group, Member
from flywheel.train.ledger import lineage
from flywheel.train.loop import TrainLoop
from flywheel.train.step_batch import StepBatch
from flywheel.train.trainer import Trainer

from bus_reading import everything_on_the_bus
from factories import platform
from tenant_traffic import TENANTS_SETUP, converse, learning
from waiting import until

RETRAIN = [*TENANTS_SETUP, "train.checkpoint_interval=1", "train.keep_checkpoints=10"]


def forget_command(tmp_path, nats_url):
    return command("forget", "--tenant", "acme", "--user", "bob", "--retrain", f"run_dir={tmp_path}",
                   f"bus.url={nats_url}", *RETRAIN)


async def test_retrain_rebuilds_the_weights_from_the_others_samples(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *RETRAIN) as (serve, _, _):
        async with learning(serve, nats_url) as train:
            for number, (user, reward) in enumerate([("ada", 1.0), ("bob", -1.0), ("ada", -0.5), ("bob", 0.5)], 1):
                await converse(serve, user, f"{user}-{number}", reward)  # one step each, in this order
                await until(lambda: train.trainer.step_count == number)
        config = serve.config
        original = {s["step"]: s["samples"] for s in lineage(tmp_path / "trained.jsonl")}
        done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    retrained = json.loads(done.stdout)["retrained"]
    # Bob's first sample was step 2: from the checkpoint of step 1, steps 2-4 again without his two.
    assert retrained == {"from_step": 1, "steps": 1, "samples": 1, "left_out": 2, "missing": 0,
                         "version": retrained["version"]}
    assert retrained["version"] > 4

    # What the trainer's own step gives on Ada's second sample from the step-1 checkpoint.
    [ada_second] = [s.record async for s in stored_records(bus, "SAMPLES") if sample_digest(s.record.id) in original[3]]
    assert await bus.resolve(ada_second)
    model, tokenizer = load_model(config.model)
    trainer = Trainer(model, config.actor, config.train)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=10)
    state = checkpoints.load(checkpoints.path(1), trainer.model)
    trainer.restore(state["trainer"])
    baseline = RunningBaseline()
    baseline.value = state["loop"]["baseline"]
    group = Group(f"sample:{ada_second.id}", 1, 0.0, 0.0, {ada_second.id: Member(ada_second, [])})
    threads = torch.get_num_threads()
    torch.set_num_threads(config.train.torch_threads)  # as the trainer and the retrain compute
    try:
        trainer.step(StepBatch([group], config, baseline, tokenizer.pad_token_id or 0).minibatches)
    finally:
        torch.set_num_threads(threads)

    assert checkpoints.steps() == [1, 2]  # the steps after 1 that learned from Bob are gone
    rebuilt, _ = load_model(config.model)
    load_weights(rebuilt, checkpoints.path(2))
    for (name, expected), got in zip(trainer.model.state_dict().items(), rebuilt.state_dict().values()):
        torch.testing.assert_close(got, expected, msg=name)
    bob = set(original[2]) | set(original[4])
    assert [s["samples"] for s in lineage(tmp_path / "trained.jsonl")] == [original[1], original[3]]
    assert not bob & {d for line in (tmp_path / "checkpoints").rglob("state.pt")
                      for d in torch.load(line, weights_only=False)["loop"]["trained"]}

    announced = await bus.last("flywheel.weights")
    assert announced.version == retrained["version"] and announced.config["retrained_without"] == "acme/bob"
    assert not bob & set(announced.trained_on["sample_digests"])
    [audited] = [s.record async for s in stored_records(bus, "AUDIT") if s.record.action == "retrain"]
    assert audited.target == f"v{retrained['version']}" and audited.details["without"] == "acme/bob"

    again = TrainLoop(config, nats_url)  # a trainer started now continues from the rebuilt weights
    await again.start()
    try:
        assert again.trainer.step_count == 2 and again.version == retrained["version"]
    finally:
        await again.stop()


HOLD = "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); input()"


async def test_retrain_refuses_while_a_trainer_runs_and_removes_nothing(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *RETRAIN) as (serve, _, _):
        await converse(serve, "bob", "bob-1")
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "train.lock")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "held\n"  # another process's trainer holds the run directory
            done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url), capture_output=True,
                                           text=True)
            refused = TrainLoop(serve.config, nats_url)
            with pytest.raises(ConfigError, match="one trainer per run directory"):
                await refused.start()
            assert refused.bus.nc.is_closed
        finally:
            holder.kill()
            holder.wait()
    assert done.returncode == 1 and "stop the trainer" in done.stderr and "nothing was removed" in done.stderr
    assert b"bob-1" in await everything_on_the_bus(bus)
