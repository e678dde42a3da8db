"""`flywheel forget --tenant T --user U --retrain` under `adapters.kind: lora`: the adapters a
forgotten user trained with others (their tenant's, `adapters.scope: tenant`) rebuilt without their
samples, on a real bus after real loops trained on three users' traffic. The rebuilt adapter is what
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


def forget_command(tmp_path, nats_url, user: str, *overrides: str):
    return command("forget", "--tenant", "acme", "--user", user, "--retrain", f"run_dir={tmp_path}",
                   f"bus.url={nats_url}", *TENANT_ADAPTER, *overrides)


def weights_of(saved: dict) -> dict[str, torch.Tensor]:
    """An adapter's weights as a checkpoint holds them (in memory, or in its file)."""
    return saved["weights"] if "weights" in saved else torch.load(saved["file"].path, weights_only=False)["weights"]


async def test_a_tenants_adapter_is_rebuilt_from_its_other_users_samples_forget_after_forget(nats_url, tmp_path, bus):
    """Acme's adapter takes a step on each of ada, bob, cy and ada again (a checkpoint each). Bob
    forgotten: from checkpoint 1, cy's and ada's steps again (v5, v6). Then cy forgotten: from
    checkpoint 2, which holds the adapter as rebuilt by step 2 (ada's first alone), ada's second
    step again (v7): what the trainer's own step gives on it from checkpoint 1. (Had checkpoint 2
    held the rebuilt adapter of step 4, cy's step would have stayed in it.)"""
    async with platform(nats_url, tmp_path, *TENANT_ADAPTER) as (serve, _, _):
        async with learning(serve, nats_url) as train:
            for number, (user, reward) in enumerate([("ada", 1.0), ("bob", -1.0), ("cy", 0.5), ("ada", -0.5)], 1):
                await converse(serve, user, f"{user}-{number}", reward)  # one step of acme's adapter each
                await until(lambda: train.trainer.step_count == number)
            await published(serve, "acme", 4)
        config = serve.config
        original = {s["step"]: s["samples"] for s in lineage(tmp_path / "trained.jsonl")}
        retrained = []
        for user in ("bob", "cy"):
            done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url, user), capture_output=True,
                                           text=True)
            assert done.returncode == 0, done.stderr
            retrained += json.loads(done.stdout)["retrained"]
            await published(serve, "acme", retrained[-1]["version"])  # the gateway serves the rebuilt adapter
    assert retrained == [{"adapter": "acme", "from_step": 1, "steps": 2, "samples": 2, "left_out": 1, "missing": 0,
                          "version": 6},
                         {"adapter": "acme", "from_step": 2, "steps": 1, "samples": 1, "left_out": 1, "missing": 0,
                          "version": 7}]

    samples = {sample_digest(s.record.id): s.record async for s in stored_records(bus, "SAMPLES")}
    model, tokenizer = load_model(config.model)
    trainer = Trainer(model, config.actor, config.train, config.adapters)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=10)
    state = checkpoints.load(checkpoints.path(1), None)
    trainer.adapters.restore(state["trainer"]["adapters"])
    at_start = {key: value.clone() for key, value in trainer.adapters.weights("acme").items()}
    baseline = RunningBaseline()
    baseline.of("acme").value = state["loop"]["adapter_baselines"]["acme"]
    [ada_second] = [samples[d] for d in original[4]]
    assert await bus.resolve(ada_second)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.train.torch_threads)  # as the trainer and the retrain compute
    try:
        take_again(trainer, [ada_second], config, baseline, tokenizer.pad_token_id or 0)
    finally:
        torch.set_num_threads(threads)
    expected = trainer.adapters.weights("acme")
    assert any(not torch.equal(expected[key], at_start[key]) for key in expected)  # the step learned something

    def assert_holds(weights: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], where: str) -> None:
        assert weights.keys() == wanted.keys()
        for key, value in wanted.items():
            torch.testing.assert_close(weights[key], value, msg=f"{where}: {key}")

    store = AdapterStore(tmp_path / "adapters")
    assert store.versions("acme") == [7]  # those trained on bob's or cy's samples, or after them, are gone
    assert_holds(load_file(store.path("acme", 7) / WEIGHTS_FILE), expected, "v7")
    gone = set(original[2]) | set(original[3])
    for step, wanted, version in ((2, at_start, 1), (3, at_start, 1), (4, expected, 7)):
        later = torch.load(checkpoints.path(step) / "state.pt", weights_only=False)
        [acme] = [a for a in later["trainer"]["adapters"] if a["name"] == "acme"]
        assert_holds(weights_of(acme), wanted, f"checkpoint {step}")
        assert later["loop"]["adapters"]["versions"]["acme"] == version and not gone & set(later["loop"]["trained"])
    assert [(s["samples"], s["version"]) for s in lineage(tmp_path / "trained.jsonl")] == [(original[1], 1),
                                                                                             (original[4], 7)]
    audited = [s.record async for s in stored_records(bus, "AUDIT") if s.record.action == "retrain"]
    assert [(a.target, a.details["without"]) for a in audited] == [("acme v6", "acme/bob"), ("acme v7", "acme/cy")]

    again = TrainLoop(config, nats_url)  # a trainer started now goes on from the rebuilt adapter
    await again.start()
    try:
        assert again.adapter_versions.versions["acme"] == 7
        assert_holds(again.trainer.adapters.weights("acme"), expected, "restarted")

        async def carried_out() -> bool:  # the forgets made while it was stopped (the rewrites kept its place)
            done = [s.record.target async for s in stored_records(bus, "AUDIT") if s.record.action == "forget.adapters"]
            return done == ["acme/bob", "acme/cy"]
        await until(carried_out, timeout_s=30)
    finally:
        await again.stop()


async def test_under_promotion_the_command_refuses_before_removing_anything(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *TENANT_ADAPTER) as (serve, _, _):
        await converse(serve, "bob", "bob-1")
        done = await asyncio.to_thread(subprocess.run, forget_command(tmp_path, nats_url, "bob", *GATE),
                                       capture_output=True, text=True)
    assert done.returncode == 1 and "under promotion" in done.stderr and "nothing was removed" in done.stderr
    assert b"bob-1" in await everything_on_the_bus(bus)
