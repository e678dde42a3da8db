"""Shared and tenant LoRA adapters earn their traffic (`adapters.kind: lora`, `promotion.mode: gate`):
each adapter is a line of the version registry of its own. Against a real bus, a real evaluation
server (`tiny`) and real adapters: a version that answers like the serving one passes the gate and
serves (the routing names it), a wrecked one is rejected and the trainer told to go back, and an
end user's own adapter never enters the registry; a gateway serves a tenant's adapter only once
the routing names it, a user's as announced; the trainer goes back on a directive with its
versions still counting up, keeps pace with the adapter's serving version, counts staleness on the
line and never prunes what serves. The evaluation server generates with the adapters the gate
loaded, for the operator's key only. Under `promotion.mode: canary` an adapter's version goes
through a canary of its own line."""

from __future__ import annotations

import contextlib

import httpx
import msgspec
import torch

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, WeightUpdate
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.models import load_model
from flywheel.models.adapter_names import user_adapter
from flywheel.models.adapter_store import AdapterStore
from flywheel.promote.decisions import Decisions
from flywheel.promote.loop import PromoteLoop
from flywheel.serve.loop import ServeLoop
from flywheel.train.adapter_versions import AdapterVersions
from flywheel.train.loop import TrainLoop
from flywheel.train.trainer import Trainer
from flywheel.versions.records import (
    Arm,
    Routing,
    TrainerDirective,
    Transition,
    VersionEntry,
)
from flywheel.versions.registry import Registry, send_command

from bus_reading import recorded_turns
from factories import platform, sample_of, sampled_turns
from tenant_traffic import TENANTS_SETUP, converse, learning
from waiting import until

LORA = ["adapters.kind=lora", "adapters.rank=4", "adapters.alpha=8", "rollout.enabled=false"]
GATE = ["promotion.mode=gate", "promotion.gate.suites=[{name: digits, env: digits, items: 6, max_new_tokens: 12}]",
        "promotion.gate.guards.probe_prompts=4", "promotion.gate.temperature=1.0",
        "promotion.gate.guards.max_kl=0.01"]  # the untrained tiny is near uniform: a wrecked adapter moves it ~0.04
USER = user_adapter("acme", "ada")


def adapter_set(config):
    model, _ = load_model("tiny")
    return Trainer(model, config.actor, config.train, config.adapters).adapters


def wreck(adapters, name: str) -> None:
    """A and B at random and large: every layer of `name` wrecked."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in adapters.params[name]:
            param.normal_(0.0, 5.0)


async def announce(bus, store: AdapterStore, adapters, name: str, version: int, parent: int) -> None:
    path = store.publish(name, version, adapters.config(name), adapters.weights(name))
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"{name}-v{version}", adapter=name, version=version,
                                                    path=str(path), step=version, parent=parent))


@contextlib.asynccontextmanager
async def promoting(nats_url: str, tmp_path, *overrides: str):
    """A promotion loop on its evaluation server: (the loop, the server)."""
    config = load_config(None, [f"run_dir={tmp_path}", *LORA, *GATE, *overrides])
    server = ServeLoop(side_server_config(config, "eval"), nats_url)
    await server.start()
    config.promotion.eval_url = server.url
    promoter = PromoteLoop(config, nats_url)
    await promoter.start()
    try:
        yield promoter, server
    finally:
        await promoter.stop()
        await server.stop()


async def test_a_tenants_adapter_passes_the_gate_or_is_rejected_and_a_users_own_never_enters(bus, nats_url, tmp_path):
    async with promoting(nats_url, tmp_path) as (promoter, server):
        registry, store, adapters = await Registry.open(bus), AdapterStore(tmp_path / "adapters"), adapter_set(promoter.config)
        adapters.ensure("acme")  # untrained: B at zero, the base exactly
        await announce(bus, store, adapters, "acme", 1, parent=0)
        one = await until(lambda: _in(registry, 1, "acme", "serving"), timeout_s=60)
        assert one.gate["passed"] and abs(one.gate["guards"]["kl"]) < 1e-6 and one.gate["suites"]["digits"]["difference"] == 0
        assert [t.state for t in one.transitions] == ["candidate", "evaluating", "serving"]
        routed = await until(lambda: _routed(registry, "acme"))  # written after the entry
        assert routed == Arm(version=1, path=str(store.path("acme", 1)))

        adapters.ensure(USER)
        await announce(bus, store, adapters, USER, 1, parent=0)  # a user's own: published to its user alone
        wreck(adapters, "acme")
        await announce(bus, store, adapters, "acme", 2, parent=1)
        two = await until(lambda: _decided(registry, 2, "acme"), timeout_s=60)
        assert two.state == "rejected" and two.gate["serving"] == 1 and two.gate["guards"]["kl"] > 0.01
        directive = await until(lambda: registry.directive("acme"))  # written after the entry
        assert (directive.adapter, directive.version, directive.rejected) == ("acme", 1, 2)
        assert directive.path == str(store.path("acme", 1)) and await registry.directive() is None
        assert (await registry.routing()).adapters["acme"].version == 1 and await _in(registry, 1, "acme", "serving")
        assert await registry.adapters() == ["acme"] and [e.version for e in await registry.versions()] == [0]
        async with httpx.AsyncClient(base_url=server.url) as http:  # the evaluation server serves the gate's adapters only
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            assert (await http.post("/engine/generate", json={**body, "lora_path": "gate.candidate"})).status_code == 200
            refused = await http.post("/engine/generate", json={**body, "lora_path": ["gate.serving", "acme"]})
        assert refused.status_code == 400 and "base model only" in refused.text


async def test_an_operator_pins_rolls_back_and_promotes_on_an_adapters_line(bus, nats_url, tmp_path):
    """Commands name an adapter's line: pinned, its candidates wait (the shared weights' line is not
    held); a rollback serves the version that served before, else the adapter's start (the bare
    base: the routing names none), and sends the trainer back there; an adapter not in the registry
    is refused as a version that is not."""
    async with promoting(nats_url, tmp_path) as (promoter, _):
        registry, store, adapters = await Registry.open(bus), AdapterStore(tmp_path / "adapters"), adapter_set(promoter.config)
        adapters.ensure("acme")
        await announce(bus, store, adapters, "acme", 1, parent=0)
        await until(lambda: _routed(registry, "acme"), timeout_s=60)

        pinned = await send_command(bus, registry, "pin", 1, adapter="acme")
        assert pinned.ok and pinned.message == "acme@v1 serves, pinned"
        assert (await registry.routing()).pinned_adapters == ["acme"] and not (await registry.routing()).pinned
        await announce(bus, store, adapters, "acme", 2, parent=1)
        await until(lambda: _in(registry, 2, "acme", "candidate"))
        assert (await send_command(bus, registry, "promote", 0)).ok  # a round trip through the promoter
        assert await _in(registry, 2, "acme", "candidate") and promoter.counts["evaluated"] == 1  # held while pinned
        assert (await send_command(bus, registry, "unpin", adapter="acme")).ok
        await until(lambda: _in(registry, 2, "acme", "serving"), timeout_s=60)

        rolled = await send_command(bus, registry, "rollback", adapter="acme")
        assert rolled.ok and rolled.message == "acme@v2 rolled back; acme@v1 serves", rolled.message
        assert (await registry.routing()).adapters["acme"].version == 1 and await _in(registry, 2, "acme", "rolled_back")
        assert ((await registry.directive("acme")).version, (await registry.directive("acme")).rejected) == (1, 2)
        rolled = await send_command(bus, registry, "rollback", adapter="acme")
        assert rolled.ok and rolled.message == "acme@v1 rolled back; acme@v0 serves", rolled.message
        assert "acme" not in (await registry.routing()).adapters and (await registry.directive("acme")).version == 0
        again = await send_command(bus, registry, "rollback", adapter="acme")
        assert not again.ok and again.message == "no version served before acme@v0: nothing to roll back to"
        assert (await send_command(bus, registry, "promote", 1, adapter="acme")).ok
        assert (await registry.routing()).adapters["acme"].version == 1
        start = await send_command(bus, registry, "promote", 0, adapter="acme")
        assert start.ok and start.message == "acme@v0 serves" and "acme" not in (await registry.routing()).adapters
        assert await _in(registry, 1, "acme", "retired")
        back = await send_command(bus, registry, "rollback", 1, adapter="acme")  # from the start, which is no entry
        assert back.ok and await registry.get(0, "acme") is None and (await registry.routing()).adapters["acme"].version == 1
        unknown = await send_command(bus, registry, "promote", 1, adapter="other")
        assert not unknown.ok and unknown.message == "no adapter other in the registry"


async def judged(bus, turns, adapter: str, version: int, reward: float, tag: str) -> None:
    """A judged sample of each turn, sampled by `adapter`'s `version`."""
    for turn in turns:
        sample = sample_of(turn, reward, version=version)
        sample.trajectory.adapter = adapter
        await bus.publish(SAMPLE_SUBJECT, msgspec.structs.replace(sample, id=f"{sample.id}-{adapter}-{tag}"))


async def test_a_tenants_adapter_goes_through_a_canary_of_its_own(bus, nats_url, tmp_path):
    """`promotion.mode: canary`: acme@v1 passes the gate and gets the canary's share of acme's new
    sessions, its next candidate waiting meanwhile; judged sessions of acme's versions decide:
    v1 fares as well as acme's start and serves, v2 fares worse than v1 and is rolled back, the
    trainer sent back to v1. The shared weights' line has no canary throughout."""
    turns = await sampled_turns(16)
    async with promoting(nats_url, tmp_path, "promotion.mode=canary", "promotion.canary.min_sessions=8") as (promoter, _):
        registry, store, adapters = await Registry.open(bus), AdapterStore(tmp_path / "adapters"), adapter_set(promoter.config)
        adapters.ensure("acme")
        await announce(bus, store, adapters, "acme", 1, parent=0)
        await until(lambda: _in(registry, 1, "acme", "canary"), timeout_s=60)
        routing = await until(lambda: _canary_routed(registry, "acme"))  # written after the entry
        assert routing.adapter_canaries == {"acme": Arm(version=1, path=str(store.path("acme", 1)))}
        assert routing.canary_share == 0.1 and routing.canary is None and "acme" not in routing.adapters
        await announce(bus, store, adapters, "acme", 2, parent=1)
        await until(lambda: _in(registry, 2, "acme", "candidate"))  # its line's canary runs: it waits
        for i, turn in enumerate(turns):  # the arms interleaved, as traffic comes
            await judged(bus, [turn], "acme", 1, 1.0, f"a{i}")
            await judged(bus, [turn], "acme", 0, 1.0, f"a{i}")
        one = await until(lambda: _in(registry, 1, "acme", "serving"))  # decided once the test could: 8 to 16 a side
        assert min(one.canary["canary_arm"]["n"], one.canary["serving_arm"]["n"]) >= 8 and "no worse" in one.transitions[-1].reason

        await until(lambda: _in(registry, 2, "acme", "canary"), timeout_s=60)  # evaluated once v1's canary ended
        await judged(bus, turns[:8], "acme", 2, 0.0, "b")
        await judged(bus, turns[:10], "acme", 1, 1.0, "b")
        two = await until(lambda: _in(registry, 2, "acme", "rolled_back"))
        assert two.transitions[-1].by == "canary" and "worse" in two.transitions[-1].reason
        directive = await until(lambda: registry.directive("acme"))
        assert (directive.version, directive.rejected) == (1, 2) and await registry.directive() is None
        routing = await registry.routing()
        assert routing.adapters["acme"].version == 1 and not routing.adapter_canaries and routing.canary_share == 0.0


async def _canary_routed(registry: Registry, adapter: str) -> Routing | None:
    routing = await registry.routing()
    return routing if adapter in routing.adapter_canaries else None


async def _routed(registry: Registry, adapter: str) -> Arm | None:
    return (await registry.routing()).adapters.get(adapter)


async def _decided(registry: Registry, version: int, adapter: str):
    entry = await registry.get(version, adapter)
    return entry if entry is not None and entry.state not in ("candidate", "evaluating") else None


async def _in(registry: Registry, version: int, adapter: str, state: str):
    entry = await registry.get(version, adapter)
    return entry if entry is not None and entry.state == state else None


async def test_a_gateway_serves_a_tenants_adapter_once_routed_and_a_users_as_announced(bus, nats_url, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", *LORA, *GATE])
    store, adapters = AdapterStore(tmp_path / "adapters"), adapter_set(config)
    adapters.ensure("acme")
    adapters.ensure(USER)
    gateway = ServeLoop(config, nats_url)
    await gateway.start()
    try:
        registry = await Registry.open(bus)
        await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None)))
        await announce(bus, store, adapters, "acme", 1, parent=0)
        await announce(bus, store, adapters, USER, 1, parent=0)
        await until(lambda: gateway.pool.adapter_versions.get(USER) == 1)
        assert "acme" not in gateway.pool.adapter_versions  # announced before the user's, and not taken
        path = str(store.path("acme", 1))
        await registry.set_routing(Routing(id="r2", serving=Arm(version=0, path=None), adapters={"acme": Arm(version=1, path=path)}))
        await until(lambda: gateway.pool.adapter_versions.get("acme") == 1)
    finally:
        await gateway.stop()


async def test_the_trainer_goes_back_on_a_directive_keeps_pace_and_keeps_what_serves(bus, tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", *LORA, *GATE, "rollout.max_head_offpolicyness=1"])
    registry, adapters = await Registry.open(bus), adapter_set(config)
    store = AdapterStore(tmp_path / "adapters", keep=1)
    versions = AdapterVersions(store, bus, interval=1, registry=registry, max_ahead=1)
    sample = sample_of((await sampled_turns(1))[0], 1.0, 0)
    sample.trajectory.adapter = "acme"
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None)))
    adapters.ensure("acme")

    async def step(version: int) -> None:
        """A training step of acme (its weights moved, its moments filled), published."""
        with torch.no_grad():
            for param in adapters.params["acme"]:
                param.add_(0.01 * version)
                adapters.optimizers["acme"].state[param] = {"step": torch.tensor(1.0)}
        versions.trained(["acme"])
        await versions.publish(adapters, "acme", step=version)

    await versions.follow_registry(adapters)
    assert versions.may_train([sample], config)
    await step(1)
    await versions.follow_registry(adapters)
    assert not versions.may_train([sample], config)  # v1 is a candidate; at η = 1 acme waits for it
    await registry.set_routing(Routing(id="r2", serving=Arm(version=0, path=None),
                                       adapters={"acme": Arm(version=1, path=str(store.path("acme", 1)))}))
    await versions.follow_registry(adapters)
    assert versions.may_train([sample], config)
    one = adapters.weights("acme")
    await step(2)
    assert store.versions("acme") == [1, 2]  # keep=1, but v1 serves

    await registry.set_directive(TrainerDirective(id="d1", version=1, path=str(store.path("acme", 1)), abandon_after=1,
                                                  reason="acme@v2 rejected", rejected=2, adapter="acme"))
    await versions.follow_registry(adapters)
    back = adapters.weights("acme")
    assert all(torch.equal(back[k], one[k]) for k in one) and not adapters.optimizers["acme"].state
    assert versions.versions["acme"] == 2 and versions.staleness("acme", 1) == 0  # v2 abandoned: v1's weights again
    loop = TrainLoop(config, "nats://unused")  # the loop's filter of samples, on this line (a rolled-back canary's too)
    loop.adapter_versions = versions
    sampled_by = {v: msgspec.structs.replace(sample, trajectory=msgspec.structs.replace(
        sample.trajectory, segments=[msgspec.structs.replace(s, versions=[v] * len(s.versions)) for s in sample.trajectory.segments]))
        for v in (1, 2)}
    assert loop.is_abandoned(sampled_by[2]) and not loop.is_abandoned(sampled_by[1])
    await step(3)
    assert versions.staleness("acme", 1) == 1 and versions.parents["acme"] == 3
    assert store.versions("acme") == [1, 3]  # the rejected v2 pruned, the serving v1 kept
    assert not await versions.follow_registry(adapters)  # the same directive again: carried out once
    assert versions.versions["acme"] == 3

    store = AdapterStore(tmp_path / "adapters", keep=1)  # a new process: nothing protected yet
    restarted = AdapterVersions(store, bus, interval=1, registry=registry, max_ahead=1)
    restarted.restore({"versions": {"acme": 1}, "parents": {"acme": 1}})  # a checkpoint from before v2
    await restarted.restored(adapters, step=4, config=config)
    assert store.versions("acme") == [1, 4]  # published above v3, and the serving v1 kept (keep=1)


async def test_a_tenants_conversations_reach_its_adapter_through_the_gate(nats_url, tmp_path, bus):
    """End to end, `adapters.scope: tenant`: acme's rewarded conversation trains acme's adapter,
    whose v1 the gate passes; the gateway serves it from the routing, and acme's next turn is
    sampled by it."""
    overrides = [*TENANTS_SETUP, "adapters.kind=lora", "adapters.scope=tenant", "adapters.guard_drop=null",
                 "rollout.enabled=false", *GATE[:4]]
    async with platform(nats_url, tmp_path, *overrides) as (serve, _, _):
        config = side_server_config(serve.config, "eval")
        server = ServeLoop(config, nats_url)
        await server.start()
        config.promotion.eval_url = server.url
        promoter = PromoteLoop(config, nats_url)
        await promoter.start()
        try:
            async with learning(serve, nats_url):
                await converse(serve, "ada", "first", reward=1.0)
                await until(lambda: serve.pool.adapter_versions.get("acme") == 1, timeout_s=60)
                await converse(serve, "bob", "second", reward=1.0)
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer other-key"}) as http:
                sampled = await http.post("/engine/generate", json={**body, "lora_path": "gate.candidate"})
                loaded = await http.post("/engine/load_lora_adapter", json={"lora_name": "gate.candidate",
                                                                           "lora_path": str(tmp_path / "adapters" / "acme" / "v1")})
                plain = await http.post("/engine/generate", json=body)
            async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer root"}) as http:
                gated = await http.post("/engine/generate", json={**body, "lora_path": "gate.candidate"})
        finally:
            await promoter.stop()
            await server.stop()
        turns = {t.session_id.split("/", 1)[1]: t for t in await recorded_turns(bus, 2)}
    # Another tenant's key reaches no adapter on the evaluation server, nor its control routes; the
    # operator's (the gate's) does; the server never loaded the stored adapters themselves.
    assert sampled.status_code == 400 and loaded.status_code == 403 and plain.status_code == 200
    assert gated.status_code == 200 and set(server.pool.adapter_versions) <= {"gate.candidate", "gate.serving"}
    registry = await Registry.open(bus)
    one = await registry.get(1, "acme")
    assert one.state == "serving" and one.gate["passed"] and one.path.endswith("acme/v1")
    assert turns["first"].adapter == "acme" and set(turns["first"].output_versions) == {0}
    assert turns["second"].adapter == "acme" and set(turns["second"].output_versions) == {1}


async def test_a_promoter_that_died_between_an_adapters_entry_and_its_routing_repairs_the_routing(bus):
    """The entry says acme@v2 serves, the routing (written after it) still names v1, and v3's
    canary rollback has no directive yet: a restarted promoter's `repair` makes the routing name v2,
    which gateways then load, and tells the trainer to go back to v2. Likewise canaries: the
    routing's acme@v3 (rolled back) ends, beta@v1's (written to the entry only) begins."""
    config = load_config(None, [*LORA, *GATE])
    registry = await Registry.open(bus)
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None), adapters={"acme": Arm(version=1, path="/a/1")},
                                       adapter_canaries={"acme": Arm(version=3, path="/a/3")}, canary_share=0.1))
    for version, state in ((1, "retired"), (2, "serving")):
        await registry.put(VersionEntry(id=f"acme@v{version}", version=version, path=f"/a/{version}", adapter="acme", state=state))
    await registry.put(VersionEntry(id="acme@v3", version=3, path="/a/3", adapter="acme", state="rolled_back",
                                    transitions=[Transition(state="rolled_back", reason="worse", by="canary")]))
    await registry.put(VersionEntry(id="beta@v1", version=1, path="/b/1", adapter="beta", state="canary"))
    await Decisions(registry, config).repair()
    routing = await registry.routing()
    assert routing.adapters == {"acme": Arm(version=2, path="/a/2")} and routing.canary_share == 0.1
    assert routing.adapter_canaries == {"beta": Arm(version=1, path="/b/1")}
    directive = await registry.directive("acme")  # the rollback's directive, which the dead promoter had not written
    assert (directive.rejected, directive.version, directive.path) == (3, 2, "/a/2")


async def test_a_forgotten_tenants_adapter_leaves_the_registry_and_the_routing(bus):
    """Forgetting acme removes its adapter's versions announced before the forget, the routing's
    entry, an operator's pin and the trainer's directive about it (a tenant made again under the name starts a line
    the gate sees afresh); another tenant's line, and versions announced after, stay."""
    config = load_config(None, [*LORA, *GATE])
    registry = await Registry.open(bus)
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None), pinned_adapters=["acme", "other"],
                                       adapters={"acme": Arm(version=1, path="/a/1"), "other": Arm(version=1, path="/o/1")}))
    for name in ("acme", "other"):
        await registry.put(VersionEntry(id=f"{name}@v1", version=1, path=f"/{name[0]}/1", adapter=name, state="serving",
                                        transitions=[Transition(state="serving", reason="passed", by="gate", at=100.0)]))
    await registry.set_directive(TrainerDirective(id="d1", version=1, path="/a/1", abandon_after=1, reason="r",
                                                  rejected=2, adapter="acme"))
    decisions = Decisions(registry, config)
    await decisions.forget("acme", at=200.0)
    assert await registry.adapters() == ["other"] and await registry.directive("acme") is None
    assert set((await registry.routing()).adapters) == {"other"} and (await registry.routing()).pinned_adapters == ["other"]
    await registry.put(VersionEntry(id="acme@v1", version=1, path="/a/1", adapter="acme",
                                    transitions=[Transition(state="candidate", reason="new", by="trainer", at=300.0)]))
    await decisions.forget("acme", at=200.0)  # the same forget read again after a restart: the new line stays
    assert await registry.adapters() == ["acme", "other"]


async def test_a_new_users_adapter_starts_from_what_its_tenants_adapter_serves(bus, tmp_path):
    """Under the gate, a user's new adapter starts from the version of its tenant's adapter that
    serves (what the gateway served the user until now), not from the trainer's newer candidate."""
    config = load_config(None, [f"run_dir={tmp_path}", *LORA, *GATE, "adapters.scope=user"])
    registry, adapters = await Registry.open(bus), adapter_set(config)
    store = AdapterStore(tmp_path / "adapters")
    versions = AdapterVersions(store, bus, interval=1, registry=registry, max_ahead=4)
    adapters.ensure("acme")
    wreck(adapters, "acme")
    versions.trained(["acme"])
    await versions.publish(adapters, "acme", step=1)  # acme@v1, which will serve
    served = adapters.weights("acme")
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None),
                                       adapters={"acme": Arm(version=1, path=str(store.path("acme", 1)))}))
    await versions.follow_registry(adapters)
    with torch.no_grad():
        for param in adapters.params["acme"]:
            param.mul_(2.0)  # a candidate the gate has not passed
    versions.start(adapters, USER, "acme")
    mine = adapters.weights(USER)
    assert all(torch.equal(mine[k], served[k]) for k in served)
    assert not all(torch.equal(mine[k], adapters.weights("acme")[k]) for k in served)
