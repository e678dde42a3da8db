"""Personal adapters in the trainer (`adapters.kind: lora`), on the real tiny model: a step trains
only its samples' adapters, never the base, each with an optimizer of its own; an adapter the
trainer publishes is a small PEFT directory that the embedded engine serves, and the trainer
reproduces the engine's log-probs of its tokens; staleness counts each adapter's own versions;
a checkpoint holds every adapter and its optimizer, and a resumed trainer steps as one that
never stopped (adapters kept on disk: test_train_adapters_on_disk.py)."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT
from flywheel.config import load_config
from flywheel.models import load_model, resolve_model
from flywheel.models.adapter_names import adapter_for, origin
from flywheel.models.adapter_store import AdapterStore
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.loop import TrainLoop
from flywheel.train.step_batch import StepBatch

from adapter_training import (
    LORA,
    lora_trainer,
    of_adapter,
    optimizer_state,
    same,
    step_of_groups,
    take_step,
)
from factories import make_turn, prompt, recomputed_logprobs, sample_of, sampled_turns
from waiting import until


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights by their names without PEFT (LoRA layers left out)."""
    return {n.replace(".base_layer", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


async def test_a_step_trains_only_its_samples_adapters_each_with_its_own_optimizer():
    turns = await sampled_turns(4)
    config = load_config(None, LORA)
    alice = [of_adapter(turns[0], 1.0, "alice"), of_adapter(turns[1], 0.0, "alice")]
    bob = [of_adapter(turns[2], 0.0, "bob"), of_adapter(turns[3], 1.0, "bob")]
    batch = step_of_groups({"a": alice, "b": bob}, config)
    assert all(len({b.adapter for b in minibatch}) == 2 for minibatch in batch.minibatches)  # every micro-batch one adapter's
    trainer = lora_trainer(config)
    base = base_weights(trainer.model)
    trainer.adapters.ensure("alice")
    trainer.adapters.ensure("carol")  # an adapter the step has no sample of
    before = {name: trainer.adapters.weights(name) for name in ("alice", "carol")}
    metrics = take_step(trainer, batch, {"alice": 0, "bob": 0})

    assert metrics["adapters"] == ["alice", "bob"]
    assert same(base_weights(trainer.model), base)  # the base never trains
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert not same(trainer.adapters.weights("alice"), before["alice"])
    assert any(t.abs().sum() > 0 for k, t in trainer.adapters.weights("bob").items() if "lora_B" in k)  # B left 0
    assert same(trainer.adapters.weights("carol"), before["carol"])
    for name in ("alice", "bob", "carol"):  # each optimizer holds its own adapter's parameters, nothing else
        optimizer = trainer.adapters.optimizers[name]
        own = {id(p) for p in trainer.adapters.params[name]}
        assert {id(p) for group in optimizer.param_groups for p in group["params"]} == own
        assert {id(p) for p in optimizer.state} == (own if name != "carol" else set())
    # A new adapter starts as the base exactly (B = 0): the engine's log-probs, reproduced.
    assert metrics["gap_tokens"] == sum(len(t.output_ids) for t in turns) and metrics["behav_logprob_gap"] < 1e-4
    # With every adapter disabled the model is the base again (the KL reference); with alice, not.
    micro = next(b for minibatch in batch.minibatches for b in minibatch if b.adapter == "alice")
    mask = micro.loss_mask.bool()
    with torch.no_grad():
        with trainer.adapters.disabled() as base_model:
            bare = trainer.token_logprobs(micro, base_model).logp
        trained = trainer.token_logprobs(micro).logp
    assert bare[mask].tolist() == pytest.approx(micro.behav_logp[mask].tolist(), abs=2e-4)
    assert (trained - bare)[mask].abs().max() > 1e-3

    # What alice learned is what she learns alone: no other adapter's samples reach her update.
    alone = lora_trainer(config)
    alone.adapters.ensure("alice")
    take_step(alone, step_of_groups({"a": alice}, config), {"alice": 0})
    for key, value in alone.adapters.weights("alice").items():
        assert torch.allclose(value, trainer.adapters.weights("alice")[key], atol=1e-6)


async def test_a_users_new_adapter_starts_from_its_tenants():
    turns = await sampled_turns(2)
    config = load_config(None, [*LORA, "adapters.scope=user"])
    user = adapter_for("user", "acme", "u1")
    assert origin(user, config) == "acme" and origin("acme", config) is None
    assert origin(user, load_config(None, [*LORA, "adapters.scope=tenant"])) is None
    tenant_sample = sample_of(turns[0], 1.0, 0)
    tenant_sample.trajectory.tenant = "acme"
    user_sample = sample_of(turns[1], 1.0, 0)
    user_sample.trajectory.tenant, user_sample.trajectory.user_id = "acme", "u1"
    batch = step_of_groups({"t": [tenant_sample], "u": [user_sample]}, config)
    assert batch.adapters == {"acme": None, user: "acme"}  # by tenant and user, with the user's origin
    trainer = lora_trainer(config)
    take_step(trainer, step_of_groups({"t": [tenant_sample]}, config), {})
    trainer.adapters.ensure(user, origin(user, config))
    assert same(trainer.adapters.weights(user), trainer.adapters.weights("acme"))


async def test_a_resumed_trainer_takes_the_same_step_as_one_that_never_stopped(tmp_path):
    turns = await sampled_turns(4)
    config = load_config(None, [*LORA, "actor.ppo_n_minibatches=2", "actor.kl_coef=0.05"])

    def step(rewards: list[float]) -> StepBatch:
        samples = [of_adapter(t, r, "alice" if i < 2 else "bob") for i, (t, r) in enumerate(zip(turns, rewards))]
        return step_of_groups({"a": samples[:2], "b": samples[2:]}, config)

    never_stopped = lora_trainer(config)
    take_step(never_stopped, step([1.0, 0.0, 0.0, 1.0]))
    checkpoints = Checkpoints(tmp_path, keep=2)
    path = checkpoints.save(1, None, {"trainer": never_stopped.state()})
    assert sorted(p.name for p in path.iterdir()) == ["state.pt"]  # the frozen base is not saved
    resumed = lora_trainer(config, seed=99)
    resumed.restore(checkpoints.load(path, None)["trainer"])
    assert resumed.adapters.names() == ["alice", "bob"] and resumed.step_count == 1
    for name in ("alice", "bob"):
        assert same(resumed.adapters.weights(name), never_stopped.adapters.weights(name))
        for a, b in zip(optimizer_state(resumed, name), optimizer_state(never_stopped, name)):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    second = step([0.0, 1.0, 1.0, 0.0])
    metrics = [take_step(trainer, second) for trainer in (never_stopped, resumed)]
    assert metrics[0]["loss"] == metrics[1]["loss"] and metrics[0]["lr"] == metrics[1]["lr"]
    for name in ("alice", "bob"):
        assert same(resumed.adapters.weights(name), never_stopped.adapters.weights(name))


def test_the_adapter_store_keeps_the_newest_versions_and_forgets_an_adapter(tmp_path):
    store = AdapterStore(tmp_path, keep=2)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}
    for version in (1, 2, 3):
        store.publish("acme.u-1", version, {"peft_type": "LORA"}, tensors)
    store.publish("bob", 1, {"peft_type": "LORA"}, tensors)
    assert store.names() == ["acme.u-1", "bob"] and store.versions("acme.u-1") == [2, 3] and store.latest("bob") == 1
    assert load_file(store.path("acme.u-1", 3) / "adapter_model.safetensors").keys() == tensors.keys()
    with pytest.raises(FileExistsError):
        store.publish("bob", 1, {"peft_type": "LORA"}, tensors)
    with pytest.raises(FileNotFoundError):
        store.path("acme.u-1", 1)
    for bad in ("..", ".tmp-x", "a/b", ""):
        with pytest.raises(ValueError, match="not an adapter name"):
            store.versions(bad)
    assert store.delete("acme.u-1") and not store.delete("acme.u-1")
    assert store.names() == ["bob"] and sorted(p.name for p in tmp_path.iterdir()) == ["bob"]


def loop_config(tmp_path, *overrides: str):
    return load_config(None, [f"run_dir={tmp_path}", *LORA, *overrides])


def ledger(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]


async def test_a_published_adapter_is_small_serves_and_its_tokens_logprobs_are_the_trainers(bus, nats_url, tmp_path):
    """Trained on two samples, alice is published alone as v1: a PEFT directory of megabytes that
    PEFT and the embedded engine load; the engine samples with it, and the trainer, training on
    those samples, reproduces their log-probs with alice active (`behav_logprob_gap` ≈ 0)."""
    turns = await sampled_turns(2)
    loop = TrainLoop(loop_config(tmp_path, "train.batch_size=2", "rollout.max_head_offpolicyness=4"), nats_url)
    await loop.start()
    try:
        for i, turn in enumerate(turns):
            await bus.publish(SAMPLE_SUBJECT, of_adapter(turn, float(i), "alice"))
        update = await until(lambda: bus.last(WEIGHTS_SUBJECT), timeout_s=60)
        assert (update.adapter, update.version, update.step, update.parent) == ("alice", 1, 1, 0)
        path = Path(update.path)
        assert path == tmp_path / "adapters" / "alice" / "v1" and not (tmp_path / "weights").exists()
        assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert sum(f.stat().st_size for f in path.iterdir()) < (resolve_model("tiny") / "model.safetensors").stat().st_size / 10
        peft = PeftModel.from_pretrained(load_model("tiny")[0], path)  # PEFT's own reader: its keys exactly
        saved = load_file(path / "adapter_model.safetensors")
        assert same(saved, {k: v.detach() for k, v in get_peft_model_state_dict(peft).items()})

        model, tokenizer = load_model("tiny")
        engine = Engine(model, tokenizer, max_loras=2).start()
        ids = prompt(tokenizer, "Write some digits.")
        try:
            await engine.load_adapter("alice", update.path, label=str(update.version))
            results = [await engine.generate(ids, SamplingParams(max_new_tokens=8, sampling_seed=i, temperature=1.0), adapter="alice")
                       for i in range(2)]
        finally:
            engine.stop()
        assert all(r.versions == ["alice@1"] * len(r.output_ids) for r in results)
        off = max(abs(a - b) for r in results for a, b in zip(r.logprobs, recomputed_logprobs(model, ids, r.output_ids)))
        assert off > 1e-3  # alice is not the base any more
        sampled = [make_turn(id=f"a{i}", session_id=f"a{i}", prompt_ids=ids, output_ids=r.output_ids, output_logprobs=r.logprobs,
                             output_versions=[1] * len(r.output_ids), adapter="alice",
                             sampling={"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": i})
                   for i, r in enumerate(results)]
        for i, turn in enumerate(sampled):
            await bus.publish(SAMPLE_SUBJECT, of_adapter(turn, float(i), "alice", version=None))
        async def second_version():
            update = await bus.last(WEIGHTS_SUBJECT)
            return update if update.version == 2 else None

        second = await until(second_version, timeout_s=60)
        assert (second.adapter, second.version, second.parent) == ("alice", 2, 1)
    finally:
        await loop.stop()
    line = [json.loads(raw) for raw in (tmp_path / "metrics.jsonl").read_text().splitlines()][1]
    assert line["gap_tokens"] == sum(len(r.output_ids) for r in results)
    assert line["behav_logprob_gap"] < 1e-4  # float noise: the engine's distribution with alice, reproduced
    assert [(s["adapter"], s["version"], len(s["samples"])) for s in ledger(tmp_path)[1:]] == [("alice", 1, 2), ("alice", 2, 2)]


async def test_staleness_counts_each_adapters_own_versions(bus, nats_url, tmp_path):
    """With η = 0: after alice's first step, a version-0 sample of bob is fresh (bob is at 0) and
    trains, while a version-0 sample of alice is stale and dropped."""
    turns = await sampled_turns(4)
    loop = TrainLoop(loop_config(tmp_path, "train.batch_size=1", "rollout.max_head_offpolicyness=0"), nats_url)
    await loop.start()
    try:
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[0], 1.0, "alice", 0))
        await until(lambda: loop.trainer.step_count == 1, timeout_s=30)
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[1], 1.0, "bob", 0))
        await until(lambda: loop.trainer.step_count == 2, timeout_s=30)
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[2], 1.0, "alice", 0))
        await until(lambda: loop.counts["stale_dropped"] == 1, timeout_s=30)
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[3], 1.0, "alice", 1))
        await until(lambda: loop.trainer.step_count == 3, timeout_s=30)
    finally:
        await loop.stop()
    assert loop.adapter_versions.versions == {"alice": 2, "bob": 1}
    assert dict(loop.staleness_seen) == {0: 3} and loop.counts["samples"] == 3
    assert [(s["adapter"], s["version"]) for s in ledger(tmp_path)[1:]] == [("alice", 1), ("bob", 1), ("alice", 2)]


async def test_an_adapter_is_published_every_interval_of_its_own_steps(bus, nats_url, tmp_path):
    """With `train.weight_update_interval` 2: alice's second step publishes her, alone, as v2;
    bob, one step in, is not published."""
    turns = await sampled_turns(3)
    loop = TrainLoop(loop_config(tmp_path, "train.batch_size=1", "rollout.max_head_offpolicyness=4",
                                 "train.weight_update_interval=2"), nats_url)
    await loop.start()

    async def announced():
        """The newest announcement (the only one, if bob was not published), once there is one."""
        return await bus.last(WEIGHTS_SUBJECT)

    try:
        for i, name in enumerate(("alice", "bob", "alice")):
            await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[i], 1.0, name, 0))
            await until(lambda i=i: loop.trainer.step_count == i + 1, timeout_s=30)
        update = await until(announced, timeout_s=30)
        assert (update.adapter, update.version, update.step) == ("alice", 2, 3)
    finally:
        await loop.stop()
    store = AdapterStore(tmp_path / "adapters")
    assert store.names() == ["alice"] and store.versions("alice") == [2]


@pytest.mark.parametrize("resident", [64, 1])
async def test_a_restarted_train_loop_has_every_adapter_its_optimizer_and_versions(bus, nats_url, tmp_path, resident):
    """Also with one adapter in memory (alice waits on disk, and its checkpoint names her file)."""
    turns = await sampled_turns(3)
    overrides = ["train.batch_size=1", "rollout.max_head_offpolicyness=4", "train.checkpoint_interval=1",
                 f"adapters.train_resident={resident}"]
    first = TrainLoop(loop_config(tmp_path, *overrides), nats_url)
    await first.start()
    for i, name in enumerate(("alice", "bob")):
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[i], 1.0, name, 0))
        await until(lambda i=i: first.trainer.step_count == i + 1, timeout_s=30)
    await first.stop()
    held = torch.load(first.checkpoints.latest() / "state.pt", weights_only=False)["trainer"]["adapters"]
    assert ["file" in a for a in held] == [resident == 1, False]
    saved = {name: (first.trainer.adapters.weights(name), optimizer_state(first.trainer, name)) for name in ("alice", "bob")}

    second = TrainLoop(loop_config(tmp_path, *overrides, "train.resume=true"), nats_url)
    await second.start()
    try:
        assert second.trainer.adapters.names() == ["alice", "bob"] and second.trainer.step_count == 2
        assert second.adapter_versions.versions == {"alice": 1, "bob": 1}
        for name, (weights, state) in saved.items():
            assert same(second.trainer.adapters.weights(name), weights)
            for a, b in zip(optimizer_state(second.trainer, name), state):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        await bus.publish(SAMPLE_SUBJECT, of_adapter(turns[2], 1.0, "bob", 1))
        await until(lambda: second.trainer.step_count == 3, timeout_s=30)
        await until(lambda: second.adapter_versions.versions == {"alice": 1, "bob": 2}, timeout_s=30)  # published after the step
    finally:
        await second.stop()
    assert AdapterStore(tmp_path / "adapters").versions("bob") == [1, 2]


async def test_a_trainer_that_died_after_publishing_gives_the_adapter_a_newer_version(bus, nats_url, tmp_path):
    """alice v1 is in the store but in no checkpoint (the trainer died after publishing it): the
    restarted trainer's alice (its initial state again) becomes v2, published and announced, so
    that no version names two sets of weights."""
    published = AdapterStore(tmp_path / "adapters").publish(
        "alice", 1, {"peft_type": "LORA"}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)})
    loop = TrainLoop(loop_config(tmp_path), nats_url)
    await loop.start()
    try:
        assert loop.trainer.adapters.names() == ["alice"] and loop.adapter_versions.versions == {"alice": 2}
        update = await bus.last(WEIGHTS_SUBJECT)
        assert (update.adapter, update.version) == ("alice", 2) and Path(update.path) == published.parent / "v2"
        weights = load_file(published.parent / "v2" / "adapter_model.safetensors")
        assert all(not t.any() for k, t in weights.items() if "lora_B" in k)  # the initial state: B = 0
    finally:
        await loop.stop()
