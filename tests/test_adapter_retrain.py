"""`flywheel forget --tenant T --user U --retrain` under `adapters.kind: lora`: the adapters a
forgotten user trained with others (their tenant's, `adapters.scope: tenant`) rebuilt without their
samples, on a real bus after real loops trained on two users' traffic. The rebuilt adapter is what
the trainer's own steps give on the remaining samples from the last checkpoint before the forgotten
user's first; it is published as the adapter's next version and served, replaces the adapter in
the later checkpoints and its lineage, is audited, and a trainer that starts again goes on from it.
Under promotion the command refuses before removing anything."""

import asyncio
import json
import subprocess

import torch
from safetensors.torch import load_file

from flywheel.bus.records import sample_digest
from flywheel.bus.scan import stored_records
from flywheel.cli import command
from flywheel.models import load_model
from flywheel.models.adapter_store import AdapterStore
from flywheel.models.lora_adapter import WEIGHTS_FILE
from flywheel.train.advantages import RunningBaseline
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.ledger import lineage
from flywheel.train.loop import TrainLoop
from flywheel.train.retrain import take_again
from flywheel.train.trainer import Trainer

from bus_reading import everything_on_the_bus
from factories import platform
from tenant_traffic import TENANTS_SETUP, converse, learning, published
from waiting import until

TENANT_ADAPTER = [*TENANTS_SETUP, "adapters.kind=lora", "adapters.scope=tenant", "actor.optimizer.lr=0.05",
                  "adapters.guard_drop=null", "train.checkpoint_interval=1", "train.keep_checkpoints=10"]


GATE = ["promotion.mode=gate", "promotion.gate.suites=[{name: digits, env: digits, items: 6}]", "rollout.enabled=false"]


def forget_command(tmp_path, nats_url, *overrides: str):
    return command("forget", "--tenant", "acme", "--user", "bob", "--retrain", f"run_dir={tmp_path}",
                   f"bus.url={nats_url}", *TENANT_ADAPTER, *overrides)


def weights_of(saved: dict) -> dict[str, torch.Tensor]:
    """An adapter's weights as a checkpoint holds them (in memory, or in its file)."""
    return saved["weights"] if "weights" in saved else torch.load(saved["file"].path, weights_only=False)["weights"]


async def test_a_tenants_adapter_is_rebuilt_from_its_other_users_samples(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *TENANT_ADAPTER) as (serve, _, _):
        async with learning(serve, nats_url) as train:
            for number, user in enumerate(["ada", "bob", "ada", "bob"], 1):  # one step of acme's adapter each
                await converse(serve, user, f"{user}-{number}")
                await until(lambda: train.trainer.step_count == number)
            await published(serve, "acme", 4)
        config = serve.config
        original = {s["step"]: s["samples"] for s in lineage(tmp_path / "trained.jsonl")}
        done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        [retrained] = json.loads(done.stdout)["retrained"]
        await published(serve, "acme", retrained["version"])  # the gateway serves the rebuilt adapter
    # Bob's first sample was step 2: from the checkpoint of step 1, steps 2-4 again without his two.
    assert retrained == {"adapter": "acme", "from_step": 1, "steps": 1, "samples": 1, "left_out": 2, "missing": 0,
                         "version": 5}

    # What the trainer's own step gives on Ada's second sample from the step-1 checkpoint.
    [ada_second] = [s.record async for s in stored_records(bus, "SAMPLES") if sample_digest(s.record.id) in original[3]]
    assert await bus.resolve(ada_second)
    model, tokenizer = load_model(config.model)
    trainer = Trainer(model, config.actor, config.train, config.adapters)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=10)
    state = checkpoints.load(checkpoints.path(1), None)
    trainer.adapters.restore(state["trainer"]["adapters"])
    baseline = RunningBaseline()
    baseline.of("acme").value = state["loop"]["adapter_baselines"]["acme"]
    take_again(trainer, [ada_second], config, baseline, tokenizer.pad_token_id or 0)
    expected = trainer.adapters.weights("acme")

    served = load_file(AdapterStore(tmp_path / "adapters").path("acme", 5) / WEIGHTS_FILE)
    assert served.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(served[key], value, msg=key)
    bob = set(original[2]) | set(original[4])
    for step in (2, 3, 4):  # every checkpoint after the start holds the rebuilt adapter, and none of Bob's samples
        later = torch.load(checkpoints.path(step) / "state.pt", weights_only=False)
        [acme] = [a for a in later["trainer"]["adapters"] if a["name"] == "acme"]
        for key, value in expected.items():
            torch.testing.assert_close(weights_of(acme)[key], value, msg=f"step {step}: {key}")
        assert later["loop"]["adapters"]["versions"]["acme"] == 5 and not bob & set(later["loop"]["trained"])
    assert [(s["samples"], s["version"]) for s in lineage(tmp_path / "trained.jsonl")] == [(original[1], 1),
                                                                                             (original[3], 5)]
    [audited] = [s.record async for s in stored_records(bus, "AUDIT") if s.record.action == "retrain"]
    assert audited.target == "acme v5" and audited.details["without"] == "acme/bob"

    again = TrainLoop(config, nats_url)  # a trainer started now goes on from the rebuilt adapter
    await again.start()
    try:
        assert again.adapter_versions.versions["acme"] == 5
        for key, value in again.trainer.adapters.weights("acme").items():
            torch.testing.assert_close(value, expected[key], msg=key)
    finally:
        await again.stop()


async def test_under_promotion_the_command_refuses_before_removing_anything(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *TENANT_ADAPTER) as (serve, _, _):
        await converse(serve, "bob", "bob-1")
        done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url, *GATE),
                                       capture_output=True, text=True)
    assert done.returncode == 1 and "under promotion" in done.stderr and "nothing was removed" in done.stderr
    assert b"bob-1" in await everything_on_the_bus(bus)
