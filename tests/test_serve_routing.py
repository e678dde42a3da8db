"""Serving under promotion: the gateway follows the registry's routing, a canary's share of new
sessions goes to a second embedded engine on the canary version, sessions stay on the version
they started with, a promotion moves everyone to it, and a rollback loads an older version; a
tenant's adapter has a canary of its own on the same engines.
Real gateway, real engines, the official `openai` client; versions read from the recorded turns."""

from collections import defaultdict
from contextlib import asynccontextmanager

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model
from flywheel.models.adapter_names import canary_name
from flywheel.serve.loop import ServeLoop
from flywheel.serve.routing import WEIGHTS, SessionArms, canary_draw
from flywheel.versions.records import Arm, Routing, VersionEntry
from flywheel.versions.registry import Registry

from bus_reading import recorded_turns
from peft_adapters import LINEAR, random_adapters
from waiting import until

SUITE = "promotion.gate.suites=[{name: digits, env: digits, items: 4}]"


def test_the_canary_draw_is_uniform_and_fixed_by_session_and_version():
    draws = [canary_draw(f"session-{i}", 3) for i in range(4000)]
    assert 0.08 < sum(d < 0.1 for d in draws) / len(draws) < 0.12
    assert canary_draw("a", 3) == canary_draw("a", 3) != canary_draw("a", 4)


def test_session_arms_keep_each_lines_draw_apart_and_sticky():
    arms = SessionArms(100)
    drawn = [s for s in SESSIONS if canary_draw(s, 2) < 0.5]
    assert not arms.on_canary("acme", "early", None, 0.5)  # begun before acme's canary
    assert [s for s in ["early", *SESSIONS] if arms.on_canary("acme", s, 2, 0.5)] == drawn  # "early" never drawn
    assert [s for s in SESSIONS if arms.on_canary("acme", s, 2, 0.5)] == drawn  # the same arm on every later turn
    assert not any(arms.on_canary("acme", s, 3, 0.5) for s in SESSIONS)  # a later canary takes new sessions only
    assert not any(arms.on_canary("acme", s, None, 0.5) for s in drawn)  # the canary ended: the serving arm
    assert [s for s in SESSIONS if arms.on_canary(WEIGHTS, s, 2, 0.5)] == drawn  # another line draws for itself
    assert arms.counts == {("acme", "canary"): len(drawn), ("acme", "serving"): len(SESSIONS) - len(drawn),
                           (WEIGHTS, "canary"): len(drawn), (WEIGHTS, "serving"): len(SESSIONS) - len(drawn)}


@asynccontextmanager
async def canary_gateway(bus, nats_url, tmp_path):
    """A gateway under canary promotion, the registry, version 1's weights, and `ask(session)`."""
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.max_new_tokens=4", "promotion.mode=canary", SUITE, "rollout.enabled=false"])
    serve = ServeLoop(config, nats_url)
    await serve.start()
    registry = await Registry.open(bus)
    path = str(WeightStore(tmp_path / "weights").publish(load_model("tiny")[0], 1))
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0)

    async def ask(session: str) -> None:
        await client.chat.completions.create(model=config.served_model, messages=[{"role": "user", "content": f"hi {session}"}],
                                             max_tokens=4, extra_headers={"X-Session-Id": session})

    try:
        yield serve, registry, path, ask
    finally:
        await client.close()
        await serve.stop()


async def start_a_canary(serve, registry, path: str, ask, sessions: list[str]) -> None:
    """Half of new sessions to version 1; each of `sessions` asks once, the first 8 twice."""
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None), canary=Arm(version=1, path=path),
                                       canary_share=0.5))
    await until(lambda: serve.pool.canary is not None and serve.pool.canary.weight_version == 1)
    for session in sessions:
        await ask(session)
    for session in sessions[:8]:  # second turns
        await ask(session)


SESSIONS = [f"s{i}" for i in range(24)]


async def test_canary_sessions_stay_on_the_version_they_started_with(bus, nats_url, tmp_path):
    async with canary_gateway(bus, nats_url, tmp_path) as (serve, registry, path, ask):
        await start_a_canary(serve, registry, path, ask, SESSIONS)
        versions: dict[str, set[int]] = defaultdict(set)
        for turn in await recorded_turns(bus, 32):
            versions[turn.session_id] |= set(turn.output_versions)
        assert all(len(v) == 1 for v in versions.values())  # sticky: each session on one version
        on_canary = {s for s in SESSIONS if versions[s] == {1}}
        assert on_canary == {s for s in SESSIONS if canary_draw(s, 1) < 0.5} and 0 < len(on_canary) < len(SESSIONS)
        assert serve.pool.arms.counts == {(WEIGHTS, "canary"): len(on_canary), (WEIGHTS, "serving"): len(SESSIONS) - len(on_canary)}


async def test_a_promotion_moves_every_session_to_the_promoted_version(bus, nats_url, tmp_path):
    async with canary_gateway(bus, nats_url, tmp_path) as (serve, registry, path, ask):
        await start_a_canary(serve, registry, path, ask, SESSIONS)
        await registry.set_routing(Routing(id="r2", serving=Arm(version=1, path=path)))  # promoted
        await until(lambda: serve.pool.weight_version == 1)
        for session in SESSIONS[:8]:
            await ask(session)
        moved = [t for t in (await recorded_turns(bus, 40))[32:] if t.session_id in SESSIONS[:8]]
        assert len(moved) == 8 and all(set(t.output_versions) == {1} for t in moved)  # the serving ones too


async def test_a_rollback_loads_the_older_version_again(bus, nats_url, tmp_path):
    async with canary_gateway(bus, nats_url, tmp_path) as (serve, registry, path, ask):
        await registry.set_routing(Routing(id="r2", serving=Arm(version=1, path=path)))
        await until(lambda: serve.pool.weight_version == 1)
        await ask("rolled-back")
        await registry.set_routing(Routing(id="r3", serving=Arm(version=0, path=None), reason="rolled back"))
        await until(lambda: serve.pool.weight_version == 0)  # an older version loaded
        await ask("rolled-back")
        assert [set(t.output_versions) for t in await recorded_turns(bus, 2)] == [{1}, {0}]


async def test_an_adapters_canary_answers_its_share_of_the_adapters_sessions(bus, nats_url, tmp_path):
    """acme's adapter serves v1 with v2 on canary for half of acme's new sessions: each session is
    answered by one version of acme's adapter, the canary's drawn as the shared weights' canary
    is, and the canary's engine name is no model a caller may ask for. When the canary ends its
    engine name is unloaded and every session goes on with the serving version; a line back at its
    start unloads the version it served; forgetting the tenant unloads its canary too."""
    made = random_adapters(tmp_path / "made", {f"v{i}": (i, dict(r=4, lora_alpha=8, target_modules=LINEAR)) for i in (1, 2)})
    paths = {i: str(made[f"v{i}"][0]) for i in (1, 2)}
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.max_new_tokens=4", "promotion.mode=canary", SUITE,
                                "rollout.enabled=false", "adapters.kind=lora", "adapters.scope=tenant", "serve.admin_key=root",
                                "tenants={acme: {keys: [acme-key]}}"])
    serve = ServeLoop(config, nats_url)
    await serve.start()
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)

    async def ask(session: str, model: str = config.served_model) -> None:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hi {session}"}],
                                             max_tokens=4, extra_headers={"X-Session-Id": session})

    try:
        registry = await Registry.open(bus)
        serving = Routing(id="r0", serving=Arm(version=0, path=None), adapters={"acme": Arm(version=1, path=paths[1])})
        await registry.set_routing(serving)
        await until(lambda: serve.pool.adapter_versions == {"acme": 1})
        for session in SESSIONS[:8]:  # sessions begun before the canary
            await ask(session)
        await registry.put(VersionEntry(id="acme@v2", version=2, path=paths[2], adapter="acme", state="canary"))
        await registry.set_routing(msgspec.structs.replace(serving, id="r1", adapter_canaries={"acme": Arm(version=2, path=paths[2])},
                                                           canary_share=0.5))
        await until(lambda: serve.pool.adapter_versions == {"acme": 1, canary_name("acme"): 2})
        for session in SESSIONS:
            await ask(session)
        kept = len(serve.pool.arms)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await ask("s0", canary_name("acme"))
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
            metrics = await until(lambda: _metrics(http, "acme"), timeout_s=30)
        await registry.set_routing(Routing(id="r2", serving=Arm(version=0, path=None), adapters={"acme": Arm(version=2, path=paths[2])}))
        await until(lambda: serve.pool.adapter_versions == {"acme": 2})  # promoted: the canary's name unloaded
        for session in SESSIONS[:8]:
            await ask(session)
        turns = await recorded_turns(bus, 40)
        await registry.set_routing(Routing(id="r3", serving=Arm(version=0, path=None),  # acme back at its start, a canary
                                           adapter_canaries={"acme": Arm(version=1, path=paths[1])}, canary_share=0.5))
        await until(lambda: serve.pool.adapter_versions == {canary_name("acme"): 1})  # the bare base serves acme's line
        await bus.publish(AUDIT_SUBJECT, AuditEntry(id="forget-acme", actor="test", action="forget", target="acme",
                                                    details={"tenant": "acme"}))
        await until(lambda: serve.pool.adapter_versions == {})  # forgotten: its canary goes too
    finally:
        await client.close()
        await serve.stop()
    versions: dict[str, set[int]] = defaultdict(set)
    for turn in turns[:32]:
        assert turn.adapter == "acme"
        versions[turn.session_id] |= set(turn.output_versions)
    assert all(len(v) == 1 for v in versions.values()) and len(versions) == len(SESSIONS)  # sticky
    before = {t.session_id for t in turns[:8]}
    assert all(versions[s] == {1} for s in before)  # begun before the canary: on the serving version throughout
    on_canary = {s for s, v in versions.items() if v == {2}}
    assert on_canary == {s for s in set(versions) - before if canary_draw(s, 2) < 0.5} and 0 < len(on_canary) < len(SESSIONS) - 8
    assert all(set(t.output_versions) == {2} for t in turns[32:40])
    assert kept == len(SESSIONS)  # acme's line alone: the frozen shared weights keep no sessions
    assert metrics == {"flywheel_canary_share": 0.5, "canary": len(on_canary), "serving": len(SESSIONS) - 8 - len(on_canary),
                       "flywheel_version_state": 1.0, "flywheel_version_online_sessions": 0.0}  # acme's line, apart


async def _metrics(http, line: str) -> dict[str, float] | None:
    """`line`'s canary share, new sessions by arm and version gauges, as Prometheus reads them;
    None until its canary's share and its canary's state show."""
    found = {}
    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        for sample in family.samples:
            if sample.labels.get("line") == line:
                found[sample.labels.get("arm", sample.name)] = sample.value
    return found if {"flywheel_canary_share", "flywheel_version_state"} <= found.keys() else None
