"""The promotion loop against a real bus, a real evaluation server (`serve.role: eval`, the tiny
model) and real weights: a version that answers like the serving one passes the gate (sampled,
item by item the same answers) and serves; a noised one is rejected (with its report, and the
trainer told to continue from the serving version), and so is what descends from it; operators'
commands roll back, promote and pin, each with its result; a promoter killed mid-evaluation comes
back to the same registry. Then the canary: its sessions' rewards against the serving version's
decide it."""

import asyncio
import sys
import time

import msgspec

from bench.promotion_drill import weights
from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, WeightUpdate
from flywheel.bus.streams import COMMANDS_SUBJECT
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.models import WeightStore
from flywheel.promote.loop import PromoteLoop
from flywheel.serve.loop import ServeLoop
from flywheel.versions.records import VersionCommand
from flywheel.versions.registry import Registry
from tests.test_train_loop import sample_of, sampled_turns
from tests.waiting import until

SUITE = "promotion.gate.suites=[{name: digits, env: digits, items: 6, max_new_tokens: 12}]"


async def announce(bus, store, version: int, parent: int, noise: float = 0.0) -> None:
    path = weights(store, version, noise)
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"w{version}", version=version, path=path, step=version, parent=parent,
                                                    metrics={"reward_mean": 0.5}, trained_on={"samples": 8}))


async def state_of(registry: Registry, version: int) -> str | None:
    entry = await registry.get(version)
    return entry and entry.state


async def command(bus, registry: Registry, kind: str, version: int | None = None):
    cmd = VersionCommand(id=f"cmd-{kind}-{version}-{time.monotonic_ns()}", kind=kind, version=version, reason="test")
    await bus.publish(COMMANDS_SUBJECT, cmd)
    results = []

    async def done():
        results[:] = [await registry.result(cmd.id)]
        return results[0] is not None

    await until(done)
    return results[0]


async def promotion(bus, nats_url: str, tmp_path, *overrides: str):
    """An evaluation server and a promotion loop on it: (config, server, promoter, registry, store)."""
    config = load_config(None, [f"run_dir={tmp_path}", SUITE, "rollout.enabled=false", *overrides])
    server = ServeLoop(side_server_config(config, "eval"), nats_url)
    await server.start()
    config.promotion.eval_url = server.url
    promoter = PromoteLoop(config, nats_url)
    await promoter.start()
    return config, server, promoter, await Registry.open(bus), WeightStore(tmp_path / "weights", keep=10)


async def test_gate_lineage_commands_and_a_restart(bus, nats_url, tmp_path):
    # It once waited out pytest-timeout's 300 s in a fresh clone's full suite (never alone, 12
    # runs of 12): the first promoter's `stop` waited for a loop that had lost its cancellation
    # (now cancelled again: bus.process.cancel_and_wait). Should anything else hang, this bound
    # fails it sooner, and every task's stack is printed (to the captured stderr) just before it.
    watchdog = asyncio.get_running_loop().call_later(145, print_every_tasks_stack)
    try:
        async with asyncio.timeout(150):
            await _gate_lineage_commands_and_a_restart(bus, nats_url, tmp_path)
    finally:
        watchdog.cancel()


def print_every_tasks_stack() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        task.print_stack(file=sys.stderr)


async def _gate_lineage_commands_and_a_restart(bus, nats_url, tmp_path):
    config, server, promoter, registry, store = await promotion(bus, nats_url, tmp_path, "promotion.mode=gate",
                                                                "promotion.gate.guards.probe_prompts=4",
                                                                "promotion.gate.temperature=1.0")
    try:
        await until(lambda: state_of(registry, 0))
        assert (await registry.routing()).serving.version == 0

        await announce(bus, store, 1, parent=0)  # the starting weights again: no worse
        await until(lambda: _is(registry, 1, "serving"))
        one = await registry.get(1)
        assert one.gate["passed"] and one.gate["guards"]["kl"] < 1e-6 and one.gate["suites"]["digits"]["items"] == 6
        # Sampled, with each item's seed shared by both versions: the same weights give every item the same answer.
        assert one.gate["suites"]["digits"]["difference"] == 0 and one.gate["suites"]["digits"]["lower_bound"] == 0
        assert [t.state for t in one.transitions] == ["candidate", "evaluating", "serving"]
        assert await state_of(registry, 0) == "retired" and (await registry.routing()).serving.version == 1

        await announce(bus, store, 2, parent=1, noise=0.5)  # harmful
        await until(lambda: _state_in(registry, 2, ("evaluating", "rejected")))
        # v3 descends from v2 (trained on while v2 was evaluated, as good as v1 itself): once v2 is
        # rejected, v3 is rejected by lineage, never evaluated and never served.
        await announce(bus, store, 3, parent=2)
        await until(lambda: _is(registry, 2, "rejected"))
        two = await registry.get(2)
        assert not two.gate["passed"] and any("KL" in r for r in two.gate["reasons"]) and two.transitions[-1].by == "gate"
        directive = await registry.directive()
        assert (directive.version, directive.abandon_after, directive.rejected) == (1, 1, 2) and "v2 rejected" in directive.reason
        await until(lambda: _is(registry, 3, "rejected"))
        three = await registry.get(3)
        assert three.transitions[-1].by == "lineage" and three.gate is None
        assert (await registry.routing()).serving.version == 1  # neither served

        result = await command(bus, registry, "rollback")
        assert result.ok and result.message == "v1 rolled back; v0 serves"
        assert (await registry.routing()).serving.version == 0 and await state_of(registry, 1) == "rolled_back"
        assert (await registry.directive()).version == 0
        refused = await command(bus, registry, "promote", 9)
        assert not refused.ok and "no version 9" in refused.message
        assert (await command(bus, registry, "pin", 1)).ok
        routing = await registry.routing()
        assert routing.pinned and routing.serving.version == 1 and await state_of(registry, 0) == "retired"

        # Pinned: a new candidate waits. The promoter dies; its successor finds everything as it was.
        await announce(bus, store, 4, parent=1)
        await until(lambda: _is(registry, 4, "candidate"))
        await promoter.stop()
        promoter = PromoteLoop(config, nats_url)
        await promoter.start()
        assert await state_of(registry, 4) == "candidate" and (await registry.routing()).pinned
        assert (await command(bus, registry, "unpin")).ok
        await until(lambda: _is(registry, 4, "serving"))
        assert [e.version for e in await registry.versions()] == [0, 1, 2, 3, 4]
    finally:
        await promoter.stop()
        await server.stop()


async def _is(registry: Registry, version: int, state: str) -> bool:
    return await state_of(registry, version) == state


async def _state_in(registry: Registry, version: int, states: tuple[str, ...]) -> bool:
    return await state_of(registry, version) in states


async def publish_samples(bus, turns, version: int, reward: float, tag: str) -> None:
    for turn in turns:
        sample = sample_of(turn, reward, version=version)
        await bus.publish(SAMPLE_SUBJECT, msgspec.structs.replace(sample, id=f"{sample.id}-{tag}"))


async def test_a_canary_is_rolled_back_on_its_sessions_rewards_and_a_good_one_promoted(bus, nats_url, tmp_path):
    turns = await sampled_turns(16)
    config, server, promoter, registry, store = await promotion(bus, nats_url, tmp_path, "promotion.mode=canary",
                                                                "promotion.gate.guards.probe_prompts=2",
                                                                "promotion.canary.min_sessions=8")
    try:
        await announce(bus, store, 1, parent=0)
        await until(lambda: _is(registry, 1, "canary"))
        routing = await registry.routing()
        assert (routing.serving.version, routing.canary.version, routing.canary_share) == (0, 1, 0.1)

        # The canary's sessions fail where the serving version's succeed. Half way, the promoter is killed.
        await publish_samples(bus, turns[:4], 1, 0.0, "a")
        await publish_samples(bus, turns[:10], 0, 1.0, "a")

        async def applied():
            state = (await registry.get(1)).canary
            return state["canary_arm"]["n"] == 4 and state["serving_arm"]["n"] == 10

        await until(applied)
        await promoter.stop()
        promoter = PromoteLoop(config, nats_url)
        await promoter.start()
        await publish_samples(bus, turns[4:8], 1, 0.0, "b")
        await until(lambda: _is(registry, 1, "rolled_back"))
        one = await registry.get(1)
        assert one.canary["canary_arm"]["n"] == 8 and one.canary["serving_arm"]["n"] == 10  # each sample once
        assert one.transitions[-1].by == "canary" and "worse by δ" in one.transitions[-1].reason
        assert (await registry.routing()).canary is None and (await registry.directive()).version == 0
        assert one.online_reward() == (8, 0.0) and (await registry.get(0)).online_reward()[0] == 10

        await announce(bus, store, 2, parent=0)  # good again
        await until(lambda: _is(registry, 2, "canary"))
        await publish_samples(bus, turns, 2, 1.0, "c")
        await publish_samples(bus, turns, 0, 1.0, "c")
        await until(lambda: _is(registry, 2, "serving"))
        routing = await registry.routing()
        assert routing.serving.version == 2 and routing.canary is None and await state_of(registry, 0) == "retired"
        assert "no worse" in (await registry.get(2)).transitions[-1].reason
    finally:
        await promoter.stop()
        await server.stop()
