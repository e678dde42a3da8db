"""An operator, or a tenant's application for its user, takes an end user's own adapter back to an
earlier version, on a live deployment (`adapters.kind: lora`, `adapters.scope: user`): `flywheel
versions rollback --tenant T --user U [N]`, `POST /admin/adapters/rollback` and `POST
/v1/adapter/rollback` put the request on the audit log, and the trainer carries
it out: N's weights published again as the adapter's next version, served to the user at once
(their tokens' log-probs are N's), and trained on from there; the other user's adapter is left
alone. Refusals (no such adapter, a version not kept, another tenant's user, a deployment without
adapters, a line under promotion), a trainer that was stopped when it was asked, and a tenant's
adapter taken back where no promotion loop has its line."""

import asyncio
import json
import subprocess
from types import SimpleNamespace

import httpx
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from flywheel.bus import TRAFFIC_SUBJECTS, Turn
from flywheel.bus.records import AuditEntry
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.models.adapter_store import AdapterStore
from flywheel.models.lora_adapter import WEIGHTS_FILE
from flywheel.train.adapter_rollback import carry_out
from flywheel.train.adapter_versions import AdapterVersions
from flywheel.train.audit_requests import AuditRequests
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.trainer import Trainer
from flywheel.versions.adapter_rollback import ROLLBACK
from flywheel.versions.registry import Registry

from bus_reading import read
from factories import platform, recomputed_logprobs
from tenant_traffic import ADA, BOB, LORA, TENANTS_SETUP, converse, learning, published
from waiting import until


async def flywheel_rollback(tmp_path, nats_url, *words: str, adapters: str = "lora") -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, command("versions", "rollback", *words,
                                                           f"run_dir={tmp_path}", f"bus.url={nats_url}",
                                                           f"adapters.kind={adapters}"),
                                   capture_output=True, text=True)


def weights(tmp_path, adapter: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(tmp_path / "adapters" / adapter / f"v{version}" / WEIGHTS_FILE)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def turn_of(bus, session: str) -> Turn:
    [turn] = await read(bus, TRAFFIC_SUBJECTS, session, 1, lambda r: isinstance(r, Turn) and r.session_id.endswith(session))
    return turn


def logprobs_under(tmp_path, adapter: str, version: int, turn: Turn) -> torch.Tensor:
    model = PeftModel.from_pretrained(load_model("tiny")[0], str(tmp_path / "adapters" / adapter / f"v{version}")).eval()
    return torch.tensor(recomputed_logprobs(model, turn.prompt_ids, turn.output_ids))


async def adas_first_two_versions(serve) -> None:
    """ada's first reward sets her baseline (v1, the base's weights); her second moves her adapter (v2)."""
    for number, reward in enumerate((1.0, -1.0)):
        await converse(serve, "ada", f"ada-{number}", reward=reward)
        await published(serve, ADA, number + 1)


async def test_a_users_adapter_rolled_back_serves_the_version_asked_and_trains_on_from_it(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA, "adapters.train_resident=1") as (serve, _, _):
        async with learning(serve, nats_url) as train:
            # ada's first reward sets her baseline; the next two move her adapter (v2, v3); bob has v1
            for number, (user, reward, version) in enumerate([("ada", 1.0, 1), ("ada", -1.0, 2), ("ada", 1.0, 3),
                                                              ("bob", 1.0, 1)]):
                await converse(serve, user, f"{user}-{number}", reward=reward)
                await published(serve, ADA if user == "ada" else BOB, version)
            assert not same(weights(tmp_path, ADA, 2), weights(tmp_path, ADA, 3))  # the check below can fail
            bobs = weights(tmp_path, BOB, 1)
            assert ADA in train.trainer.adapters.spilled  # one adapter in memory, bob's: hers is taken back from disk

            done = await flywheel_rollback(tmp_path, nats_url, "2", "--tenant", "acme", "--user", "ada",
                                           "--reason", "too terse")

            assert done.returncode == 0, done.stdout + done.stderr
            assert "v2's weights again, as v4" in done.stdout
            assert same(weights(tmp_path, ADA, 4), weights(tmp_path, ADA, 2))
            await published(serve, ADA, 4)
            assert train.adapter_versions.versions[ADA] == 4 and train.adapter_versions.parents[ADA] == 4
            assert list(train.trainer.adapters.keys) == [ADA] and BOB in train.trainer.adapters.spilled  # bounded
            assert same(train.trainer.adapters.weights(ADA), weights(tmp_path, ADA, 2))
            assert serve.pool.adapter_versions[BOB] == 1 and same(train.trainer.adapters.weights(BOB), bobs)
            ledger = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
            assert {"back_to": 2, "adapter": ADA} in ledger
            async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
                audit = (await http.get("/admin/audit")).json()["data"]
            [asked] = [e for e in audit if e["action"] == "adapter.rollback"]
            [answered] = [e for e in audit if e["action"] == "adapter.rolled_back"]
            assert asked["actor"] == "cli" and asked["target"] == "acme/ada"
            assert asked["details"] == {"adapter": ADA, "version": 2, "reason": "too terse"}
            assert answered["actor"] == "train" and answered["details"]["ok"] and answered["details"]["version"] == 4

            await converse(serve, "ada", "ada-back", reward=-1.0)
            served = await turn_of(bus, "ada-back")
            await published(serve, ADA, 5)  # trained on from v2's weights
            assert not same(weights(tmp_path, ADA, 5), weights(tmp_path, ADA, 4))

    assert served.adapter == ADA and set(served.output_versions) == {4}
    logprobs = torch.tensor(served.output_logprobs)
    torch.testing.assert_close(logprobs, logprobs_under(tmp_path, ADA, 4, served), atol=2e-4, rtol=0)  # v2's weights
    assert (logprobs - logprobs_under(tmp_path, ADA, 3, served)).abs().max() > 1e-3  # not the version taken back


async def test_a_tenants_key_takes_its_own_users_adapter_back_to_its_start_and_reaches_no_other(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        async with learning(serve, nats_url):
            await adas_first_two_versions(serve)
            second = weights(tmp_path, ADA, 2)
            assert any(t.any() for k, t in second.items() if "lora_B" in k)  # not the base's
            acme, other = ({"Authorization": f"Bearer {key}", "X-User-Id": "ada"} for key in ("acme-key", "other-key"))
            async with httpx.AsyncClient(base_url=serve.url) as http:
                assert (await http.get("/v1/adapter", headers=acme)).json() == {"object": "adapter", "versions": [1, 2],
                                                                                "serving": 2}
                theirs = await http.get("/v1/adapter", headers=other)  # other's ada has none: as if acme's did not exist
                assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "adapter_not_found"
                assert (await http.post("/v1/adapter/rollback", json={}, headers=other)).json() == theirs.json()
                unnamed = await http.get("/v1/adapter", headers={"Authorization": "Bearer acme-key"})
                assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "X-User-Id"
                unkept = await http.post("/v1/adapter/rollback", json={"version": 7}, headers=acme)
                assert unkept.status_code == 409 and "no v7" in unkept.json()["error"]["message"]
                assert (await http.post("/v1/adapter/rollback", json={"version": -1}, headers=acme)).status_code == 400
                admin = await http.post("/admin/adapters/rollback", json={"tenant": "acme", "user": "ada"}, headers=acme)
                assert admin.status_code in (401, 403)  # a client key does not open the admin API

                start = await http.post("/v1/adapter/rollback", json={"version": 0}, headers=acme)

                assert start.status_code == 200 and start.json()["version"] == 3
            await published(serve, ADA, 3)
            await converse(serve, "ada", "ada-start")
            served = await turn_of(bus, "ada-start")
            await published(serve, ADA, 4)  # trained on that turn
            async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
                again = await http.post("/admin/adapters/rollback", json={"tenant": "acme", "user": "ada", "version": 2})
                for body in ({"tenant": "../acme"}, {"tenant": ".hidden"}, {"tenant": "a/b", "user": "ada"}):
                    odd = await http.post("/admin/adapters/rollback", json=body)  # no adapter is named so
                    assert odd.status_code == 404 and odd.json()["error"]["code"] == "adapter_not_found"
            assert again.status_code == 200 and again.json()["version"] == 5
            assert same(weights(tmp_path, ADA, 5), second)
            nobody = await flywheel_rollback(tmp_path, nats_url, "--tenant", "acme", "--user", "bob")  # the trainer's refusal
            assert nobody.returncode == 1 and "acme/bob has no adapter here" in nobody.stdout
            odd = await flywheel_rollback(tmp_path, nats_url, "--adapter", "../acme")
            assert odd.returncode == 1 and "../acme has no adapter here" in odd.stdout
    base = recomputed_logprobs(load_model("tiny")[0], served.prompt_ids, served.output_ids)
    assert set(served.output_versions) == {3}
    torch.testing.assert_close(torch.tensor(served.output_logprobs), torch.tensor(base), atol=2e-4, rtol=0)


async def test_a_rollback_asked_of_a_stopped_trainer_is_carried_out_when_it_starts(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        async with learning(serve, nats_url):
            await adas_first_two_versions(serve)

        unanswered = await flywheel_rollback(tmp_path, nats_url, "--tenant", "acme", "--user", "ada", "--timeout-s", "1")
        assert unanswered.returncode == 2 and "no trainer answered" in unanswered.stdout

        async with learning(serve, nats_url) as train:
            await published(serve, ADA, 3)  # the version before her newest: v1's weights
            assert same(weights(tmp_path, ADA, 3), weights(tmp_path, ADA, 1))
            await until(lambda: train.adapter_versions.versions.get(ADA) == 3)


async def test_a_deployment_without_adapters_says_so_instead_of_waiting_for_a_trainer(nats_url, tmp_path, bus):
    done = await flywheel_rollback(tmp_path, nats_url, "--tenant", "acme", "--user", "ada", adapters="none")
    assert done.returncode == 2 and "adapters.kind: none" in done.stderr
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
            refused = await http.post("/admin/adapters/rollback", json={"tenant": "acme", "user": "ada"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "adapter_not_found"


async def test_without_promotion_a_tenants_adapter_is_taken_back_by_the_trainer(nats_url, tmp_path, bus):
    tenant_scope = [*LORA, "adapters.scope=tenant"]
    async with platform(nats_url, tmp_path, *tenant_scope) as (serve, _, _):
        async with learning(serve, nats_url):
            for number, (reward, version) in enumerate([(1.0, 1), (-1.0, 2), (1.0, 3)]):
                await converse(serve, "ada", f"ada-{number}", reward=reward)
                await published(serve, "acme", version)
            mixed = await flywheel_rollback(tmp_path, nats_url, "2", "--adapter", "acme", "--tenant", "acme")
            assert mixed.returncode == 2 and "--tenant needs --user" in mixed.stderr  # --adapter names it alone
            done = await flywheel_rollback(tmp_path, nats_url, "2", "--adapter", "acme")
            assert done.returncode == 0, done.stdout + done.stderr
            assert same(weights(tmp_path, "acme", 4), weights(tmp_path, "acme", 2))
            await published(serve, "acme", 4)
            async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
                start = await http.post("/admin/adapters/rollback", json={"tenant": "acme", "version": 0})
            assert start.status_code == 200 and start.json()["version"] == 5
            await published(serve, "acme", 5)
            assert not any(t.any() for k, t in weights(tmp_path, "acme", 5).items() if "lora_B" in k)  # the base


def trainer_of(bus, tmp_path, *names: str, registry=None) -> SimpleNamespace:
    """What of a train loop a rollback touches: its trainer (`names` its adapters) and their versions."""
    config = load_config(None, ["adapters.kind=lora"])
    trainer = Trainer(load_model("tiny")[0], config.actor, config.train, config.adapters)
    for name in names:
        trainer.adapters.ensure(name)
    return SimpleNamespace(trainer=trainer, adapter_versions=AdapterVersions(AdapterStore(tmp_path), bus, 1, registry=registry))


def asked(name: str) -> AuditEntry:
    return AuditEntry(id=f"to-start-{name}", actor="cli", action=ROLLBACK, target=name,
                      details={"adapter": name, "version": 0})


async def test_a_line_under_promotion_is_the_promotion_loops_to_take_back(tmp_path, bus):
    loop = trainer_of(bus, tmp_path, "acme", ADA, registry=await Registry.open(bus))
    versions = loop.adapter_versions

    tenants, adas = [await carry_out(loop, asked(name)) for name in ("acme", ADA)]

    assert not tenants.ok and "under promotion" in tenants.message and "--adapter acme" in tenants.message
    assert adas.ok and adas.version == 1 and versions.versions[ADA] == 1  # a user's own is nobody's line


async def test_a_request_that_failed_is_carried_out_at_the_next_step(tmp_path, bus):
    loop = trainer_of(bus, tmp_path, ADA)
    requests = AuditRequests(bus, Checkpoints(tmp_path / "checkpoints", keep=1))
    requests.pending = [request := asked(ADA)]
    roll_back = loop.adapter_versions.roll_back

    async def failing_once(*args):
        loop.adapter_versions.roll_back = roll_back
        raise OSError("the store's disk is full")

    loop.adapter_versions.roll_back = failing_once
    with pytest.raises(OSError):
        await requests.apply(loop)
    assert requests.pending == [request] and loop.adapter_versions.versions == {}

    assert await requests.apply(loop) and requests.pending == []
    assert loop.adapter_versions.versions[ADA] == 1 and not await requests.apply(loop)
