"""Forgetting deletes the forgotten user's (or tenant's) LoRA adapters everywhere, on a live
deployment (`adapters.kind: lora`): the adapter store, every engine of every gateway (the user's
next turn is a new user's: version 0, the base's log-probs), and the trainer's memory and
checkpoints; the other user's adapter, and other tenants', stay and keep serving."""

import asyncio
import json
import subprocess

import httpx
import torch
from peft import PeftModel

from flywheel.bus import TRAFFIC_SUBJECTS, WEIGHTS_SUBJECT, Turn, WeightUpdate
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.models.adapter_names import user_adapter
from flywheel.models.adapter_store import DROPPED, AdapterStore, owned_by
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.engine import Engine
from flywheel.serve.engine.server import create_engine_app
from flywheel.tenants.forgotten import Forgettings, forgets
from flywheel.train.adapter_guard import RELEVANCE_PROMPTS, AdapterGuard, Context
from flywheel.train.adapter_versions import AdapterVersions
from flywheel.train.adapters import AdapterSet
from flywheel.train.trainer import Trainer

from bus_reading import read
from factories import RunningApp, platform, recomputed_logprobs
from tenant_traffic import ADA, BOB, LORA, converse, learning, published
from waiting import until



async def flywheel_forget(tmp_path, nats_url, *who: str) -> dict:
    done = await asyncio.to_thread(subprocess.run, command("forget", *who, f"run_dir={tmp_path}", f"bus.url={nats_url}"),
                                   capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def checkpoint_files(tmp_path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted((tmp_path / "checkpoints").rglob("*")) if p.is_file())


def bobs_not_adas(tmp_path) -> bool:
    """Whether the checkpoints hold bob's adapter and not ada's (bob's too: not read while the
    trainer replaces a checkpoint)."""
    files = checkpoint_files(tmp_path)
    return BOB.encode() in files and ADA.encode() not in files


async def test_forgetting_a_user_deletes_their_adapter_everywhere_and_keeps_the_others(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        async with learning(serve, nats_url) as train:
            # Ada's first reward sets her baseline; her second moves her adapter away from the base.
            for number, (user, reward, version) in enumerate([("ada", 1.0, 1), ("ada", -1.0, 2), ("bob", 1.0, 1)]):
                adapter = user_adapter("acme", user)
                await converse(serve, user, f"{user}-{number}", reward=reward)
                await published(serve, adapter, version)
            theirs = PeftModel.from_pretrained(load_model("tiny")[0], str(tmp_path / "adapters" / ADA / "v2")).eval()
            weights = next(t for k, t in train.trainer.adapters.weights(ADA).items() if "lora_B" in k)
            assert weights.any()
            await until(lambda: ADA.encode() in checkpoint_files(tmp_path))  # it was there: the checks below can fail
            assert weights.numpy().tobytes() in checkpoint_files(tmp_path)

            report = await flywheel_forget(tmp_path, nats_url, "--tenant", "acme", "--user", "ada")

            assert report["adapters"] == 1 and ADA not in json.dumps(report)
            assert not (tmp_path / "adapters" / ADA).exists() and (tmp_path / "adapters" / BOB / "v1").is_dir()
            await until(lambda: ADA not in serve.pool.adapter_versions and ADA not in train.trainer.adapters.names())
            assert ADA not in serve.engine.adapters.loaded() and serve.pool.adapter_versions[BOB] == 1
            assert ADA not in train.adapter_versions.versions and ADA not in train.baseline.adapters
            assert ADA not in train.adapter_versions.contexts and BOB in train.adapter_versions.contexts
            assert BOB in train.trainer.adapters.names() and train.adapter_versions.versions[BOB] == 1
            await until(lambda: bobs_not_adas(tmp_path))
            assert weights.numpy().tobytes() not in checkpoint_files(tmp_path)
            async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
                audit = (await http.get("/admin/audit")).json()["data"]
            [dropped] = [e for e in audit if e["action"] == "forget.adapters"]  # the trainer says so
            assert dropped["actor"] == "train" and dropped["details"]["adapters"] == 1 and dropped["target"] == "acme/ada"
            await converse(serve, "ada", "ada-after")
            await converse(serve, "bob", "bob-after")
        turns = {t.session_id.split("/", 1)[1]: t for t in await read(
            bus, TRAFFIC_SUBJECTS, "after", 2, lambda r: isinstance(r, Turn) and r.session_id.endswith("-after"))}

    ada, bob = turns["ada-after"], turns["bob-after"]
    assert ada.adapter == ADA and set(ada.output_versions) == {0}  # a new user's adapter, not yet trained
    assert bob.adapter == BOB and set(bob.output_versions) == {1}  # his own, still
    base = recomputed_logprobs(load_model("tiny")[0], ada.prompt_ids, ada.output_ids)
    torch.testing.assert_close(torch.tensor(ada.output_logprobs), torch.tensor(base), atol=2e-4, rtol=0)
    forgotten = recomputed_logprobs(theirs, ada.prompt_ids, ada.output_ids)
    assert max(abs(a - b) for a, b in zip(forgotten, ada.output_logprobs)) > 1e-3  # not her old adapter's


async def test_a_trainer_stopped_when_a_user_was_forgotten_forgets_them_as_it_starts(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        async with learning(serve, nats_url):
            for user in ("ada", "bob"):
                await converse(serve, user, f"{user}-1")
                await published(serve, user_adapter("acme", user), 1)
        assert ADA.encode() in checkpoint_files(tmp_path)  # stopped, it checkpointed her adapter

        await flywheel_forget(tmp_path, nats_url, "--tenant", "acme", "--user", "ada")

        async with learning(serve, nats_url) as train:
            await until(lambda: bobs_not_adas(tmp_path))
            assert train.trainer.adapters.names() == [BOB]
            await converse(serve, "ada", "ada-again")  # back: a new user, her adapter's first version
            await published(serve, ADA, 1)  # not taken for a repeat of the forgotten one's version 1
            assert train.adapter_versions.versions[ADA] == 1 and (tmp_path / "adapters" / ADA / "v1").is_dir()


async def test_forgetting_a_tenant_deletes_all_its_adapters_and_no_other_tenants(nats_url, tmp_path, bus):
    names = ["acme", ADA, BOB, "acme2", user_adapter("acme2", "ada"), "other", "shared"]
    config = load_config(None, ["adapters.kind=lora", "adapters.rank=4"])
    adapters = AdapterSet(load_model("tiny")[0], config.adapters, config.actor, config.train)
    store = AdapterStore(tmp_path / "adapters")
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        for name in names:
            adapters.ensure(name)
            path = store.publish(name, 1, adapters.config(name), adapters.weights(name))
            await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"{name}-v1", version=1, path=str(path), step=1, adapter=name))
        await until(lambda: set(serve.pool.adapter_versions) == set(names))

        report = await flywheel_forget(tmp_path, nats_url, "--tenant", "acme")

        kept = names[3:]
        assert report["adapters"] == 3 and store.names() == sorted(kept)
        await until(lambda: set(serve.pool.adapter_versions) == set(kept))
        assert set(serve.engine.adapters.loaded()) == set(kept)

        # A version a step under way published after the forgetting, and this gateway loaded, goes
        # when the trainer says it dropped the tenant's adapters.
        await serve.pool.load_adapter("acme", str(store.path("other", 1)), 2)
        await bus.publish(AUDIT_SUBJECT, AuditEntry(id="dropped", actor="train", action=DROPPED, target="acme",
                                                    details={"tenant": "acme", "user": None, "adapters": 1}))
        await until(lambda: "acme" not in serve.pool.adapter_versions and "acme" not in serve.engine.adapters.loaded())


async def test_the_http_engine_client_unloads_an_adapter_once_and_then_quietly(tmp_path):
    """`/unload_lora_adapter` on `flywheel engine` (SGLang's protocol): a second gateway unloading
    the same adapter from the same engine is no error."""
    config = load_config(None, ["adapters.kind=lora", "adapters.rank=4"])
    adapters = AdapterSet(load_model("tiny")[0], config.adapters, config.actor, config.train)
    adapters.ensure(ADA)
    path = AdapterStore(tmp_path).publish(ADA, 1, adapters.config(ADA), adapters.weights(ADA))
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer).start()
    try:
        async with RunningApp(create_engine_app(engine, "tiny", "tiny")) as url:
            clients = [await HTTPEngineClient(url).connect() for _ in range(2)]
            await clients[0].load_adapter(ADA, str(path), 1)
            assert ADA in engine.adapters.loaded()
            for client in clients:
                await client.unload_adapter(ADA)
            assert ADA not in engine.adapters.loaded() and ADA not in clients[0].adapter_versions
            for client in clients:
                await client.close()
    finally:
        engine.stop()


def test_a_tenants_adapters_are_its_own_and_its_users():
    names = ["acme", ADA, "acme2", "acme2.u-1", "acme-x", "shared"]
    assert owned_by(names, "acme", None) == ["acme", ADA]
    assert owned_by(names, "acme", "ada") == [ADA]
    assert owned_by(names, "acme", "bob") == []
    assert owned_by(names, "shared", None) == []  # a tenant so named (made before the name was reserved)


def test_forgetting_a_tenant_covers_its_users_and_a_user_only_themselves():
    assert forgets(("acme", None), ("acme", "ada")) and forgets(("acme", None), ("acme", None))
    assert forgets(("acme", "ada"), ("acme", "ada"))
    assert not forgets(("acme", "ada"), ("acme", "bob")) and not forgets(("acme", "ada"), ("acme", None))
    assert not forgets(("acme", None), ("acme2", "ada"))


def test_a_forget_heard_again_with_an_earlier_time_does_not_move_it_back():
    """The collector and the judge read the audit log from its start again after a fault."""
    forgotten = Forgettings()
    forgotten.add("acme", "ada", 200.0)
    forgotten.add("acme", "ada", 100.0)
    assert forgotten.since("acme", "ada", 150.0) and not forgotten.since("acme", "ada", 250.0)
    assert forgotten.since("acme", "ada", 50.0) and not forgotten.since("acme", "bob", 50.0)


def test_the_system_messages_a_forgotten_user_gave_the_guard_go_with_them(tmp_path):
    """A tenant's adapter keeps the system messages of its newest trained conversation for the
    guard: forgetting the user whose conversation it was drops them, a tenant forgotten drops its
    adapters' all, and other tenants keep theirs."""
    config = load_config(None, ["adapters.kind=lora"])
    model, tokenizer = load_model("tiny")
    guard = AdapterGuard(Trainer(model, config.actor, config.train, config.adapters).adapters, tokenizer, None, 0.8,
                         questions=RELEVANCE_PROMPTS[:2])
    versions = AdapterVersions(AdapterStore(tmp_path), None, interval=1, guard=guard)
    hers = Context(("You are Ada's assistant.",))
    versions.contexts = {"acme": ("acme", "ada", hers), BOB: ("acme", "bob", Context(("Hi Bob.",))),
                         "umbrella": ("umbrella", "ada", Context(("You are Ada's other assistant.",)))}
    guard.relevance(None, hers)  # measured in her words: kept by them
    versions.forget("acme", "ada")
    assert list(versions.contexts) == [BOB, "umbrella"] and hers not in guard.base_relevance
    versions.forget("acme", None)
    assert list(versions.contexts) == ["umbrella"]
