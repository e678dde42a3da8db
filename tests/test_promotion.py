"""The promotion loop against a real bus, a real evaluation server (`serve.role: eval`, the tiny
model) and real weights: a version that answers like the serving one passes the gate (sampled,
item by item the same answers) and serves; a noised one is rejected (with its report, and the
trainer told to continue from the serving version), and so is what descends from it; operators'
commands roll back, promote and pin, each with its result; a promoter killed mid-evaluation comes
back to the same registry. Then the canary: its sessions' rewards against the serving version's
decide it."""

import asyncio
import contextlib
import sys
import time

import msgspec

from flywheel.bus import SAMPLE_SUBJECT
from flywheel.bus.streams import COMMANDS_SUBJECT
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.models import WeightStore
from flywheel.promote.loop import PromoteLoop
from flywheel.serve.loop import ServeLoop
from flywheel.versions.records import VersionCommand
from flywheel.versions.registry import Registry

from factories import announce, is_in_state, sample_of, sampled_turns, state_of
from waiting import until

SUITE = "promotion.gate.suites=[{name: digits, env: digits, items: 6, max_new_tokens: 12}]"


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


class Promotion:
    """A promotion loop on its evaluation server, against the test's bus."""

    def __init__(self, nats_url: str, config, server: ServeLoop, promoter: PromoteLoop, registry: Registry,
                 store: WeightStore):
        self.nats_url, self.config, self.server, self.promoter = nats_url, config, server, promoter
        self.registry, self.store = registry, store

    async def restart_promoter(self) -> None:
        """The promoter dies (stops) and a successor takes over."""
        await self.promoter.stop()
        self.promoter = PromoteLoop(self.config, self.nats_url)
        await self.promoter.start()


GATE = ("promotion.mode=gate", "promotion.gate.guards.probe_prompts=4", "promotion.gate.temperature=1.0")
CANARY = ("promotion.mode=canary", "promotion.gate.guards.probe_prompts=2", "promotion.canary.min_sessions=8")


@contextlib.asynccontextmanager
async def promoting(bus, nats_url: str, tmp_path, *overrides: str):
    """A `Promotion` (with `overrides`), once v0 is registered, serving. A gate test once waited out
    pytest-timeout's 300 s in a fresh clone's full suite (never alone, 12 runs of 12): the first
    promoter's `stop` waited for a loop that had lost its cancellation (now cancelled again:
    bus.process.cancel_and_wait). Should anything else hang, a bound of 120 s fails it sooner, and
    every task's stack is printed (to the captured stderr) just before it."""
    watchdog = asyncio.get_running_loop().call_later(115, print_every_tasks_stack)
    try:
        async with asyncio.timeout(120):
            parts = Promotion(nats_url, *await promotion(bus, nats_url, tmp_path, *overrides))
            try:
                await until(lambda: state_of(parts.registry, 0))
                assert (await parts.registry.routing()).serving.version == 0
                yield parts
            finally:
                await parts.promoter.stop()
                await parts.server.stop()
    finally:
        watchdog.cancel()


def print_every_tasks_stack() -> None:
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        task.print_stack(file=sys.stderr)


async def test_a_version_that_answers_like_the_serving_one_passes_the_gate_and_serves(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        await announce(bus, g.store, 1, parent=0)  # the starting weights again: no worse
        await until(lambda: is_in_state(g.registry, 1, "serving"))
        one = await g.registry.get(1)
        assert one.gate["passed"] and one.gate["guards"]["kl"] < 1e-6 and one.gate["suites"]["digits"]["items"] == 6
        # Sampled, with each item's seed shared by both versions: the same weights give every item the same answer.
        assert one.gate["suites"]["digits"]["difference"] == 0 and one.gate["suites"]["digits"]["lower_bound"] == 0
        assert [t.state for t in one.transitions] == ["candidate", "evaluating", "serving"]
        assert await state_of(g.registry, 0) == "retired" and (await g.registry.routing()).serving.version == 1


async def test_a_harmful_version_is_rejected_and_the_trainer_told_to_go_back_to_the_serving_one(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        await announce(bus, g.store, 1, parent=0, noise=0.5)
        await until(lambda: is_in_state(g.registry, 1, "rejected"))
        one = await g.registry.get(1)
        assert not one.gate["passed"] and any("KL" in r for r in one.gate["reasons"]) and one.transitions[-1].by == "gate"
        # The directive is written after the rejection is recorded: wait for it, not for the state alone.
        directive = await until(g.registry.directive)
        assert (directive.version, directive.abandon_after, directive.rejected) == (0, 0, 1) and "v1 rejected" in directive.reason
        assert (await g.registry.routing()).serving.version == 0


async def test_a_version_descended_from_a_rejected_one_is_rejected_by_lineage_unevaluated(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        await announce(bus, g.store, 1, parent=0, noise=0.5)  # harmful
        await until(lambda: is_in_state(g.registry, 1, "evaluating", "rejected"))
        # v2 descends from v1 (trained on while v1 was evaluated, as good as v0 itself): once v1 is
        # rejected, v2 is rejected by lineage, never evaluated and never served.
        await announce(bus, g.store, 2, parent=1)
        await until(lambda: is_in_state(g.registry, 2, "rejected"))
        two = await g.registry.get(2)
        assert two.transitions[-1].by == "lineage" and two.gate is None
        assert await state_of(g.registry, 1) == "rejected" and (await g.registry.routing()).serving.version == 0


async def test_a_rollback_serves_the_version_before_and_sends_the_trainer_back_to_it(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        await announce(bus, g.store, 1, parent=0)
        await until(lambda: is_in_state(g.registry, 1, "serving"))
        result = await command(bus, g.registry, "rollback")
        assert result.ok and result.message == "v1 rolled back; v0 serves"
        assert (await g.registry.routing()).serving.version == 0 and await state_of(g.registry, 1) == "rolled_back"
        assert (await g.registry.directive()).version == 0


async def test_a_command_naming_no_version_there_is_refused_with_the_reason(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        refused = await command(bus, g.registry, "promote", 9)
        assert not refused.ok and "no version 9" in refused.message
        assert (await g.registry.routing()).serving.version == 0


async def test_pinning_a_rolled_back_version_serves_it_pinned(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        await announce(bus, g.store, 1, parent=0)
        await until(lambda: is_in_state(g.registry, 1, "serving"))
        assert (await command(bus, g.registry, "rollback")).ok
        pinned = await command(bus, g.registry, "pin", 1)
        assert pinned.ok and pinned.message == "v1 serves, pinned"
        routing = await g.registry.routing()
        assert routing.pinned and routing.serving.version == 1 and await state_of(g.registry, 0) == "retired"


async def test_while_pinned_a_candidate_waits_across_a_promoter_restart_until_unpinned(bus, nats_url, tmp_path):
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        assert (await command(bus, g.registry, "pin", 0)).ok
        await announce(bus, g.store, 1, parent=0)
        await until(lambda: is_in_state(g.registry, 1, "candidate"))
        await g.restart_promoter()  # the promoter dies; its successor finds everything as it was
        assert await state_of(g.registry, 1) == "candidate" and (await g.registry.routing()).pinned
        assert (await command(bus, g.registry, "unpin")).ok
        await until(lambda: is_in_state(g.registry, 1, "serving"))
        assert [e.version for e in await g.registry.versions()] == [0, 1]


async def publish_samples(bus, turns, version: int, reward: float, tag: str) -> None:
    for turn in turns:
        sample = sample_of(turn, reward, version=version)
        await bus.publish(SAMPLE_SUBJECT, msgspec.structs.replace(sample, id=f"{sample.id}-{tag}"))


async def test_a_canary_whose_sessions_fare_worse_is_rolled_back_across_a_promoter_restart(bus, nats_url, tmp_path):
    turns = await sampled_turns(16)
    async with promoting(bus, nats_url, tmp_path, *CANARY) as p:
        await announce(bus, p.store, 1, parent=0)
        await until(lambda: is_in_state(p.registry, 1, "canary"))
        routing = await p.registry.routing()
        assert (routing.serving.version, routing.canary.version, routing.canary_share) == (0, 1, 0.1)

        # The canary's sessions fail where the serving version's succeed. Half way, the promoter is killed.
        await publish_samples(bus, turns[:4], 1, 0.0, "a")
        await publish_samples(bus, turns[:10], 0, 1.0, "a")

        async def applied():
            state = (await p.registry.get(1)).canary
            return state["canary_arm"]["n"] == 4 and state["serving_arm"]["n"] == 10

        await until(applied)
        await p.restart_promoter()
        await publish_samples(bus, turns[4:8], 1, 0.0, "b")
        await until(lambda: is_in_state(p.registry, 1, "rolled_back"))
        one = await p.registry.get(1)
        assert one.canary["canary_arm"]["n"] == 8 and one.canary["serving_arm"]["n"] == 10  # each sample once
        assert one.transitions[-1].by == "canary" and "worse by δ" in one.transitions[-1].reason
        directive = await until(p.registry.directive)  # written after the rollback is recorded, as is the routing
        assert directive.version == 0 and (await until(p.registry.routing)).canary is None
        assert one.online_reward() == (8, 0.0) and (await p.registry.get(0)).online_reward()[0] == 10


async def test_a_fetch_seen_again_after_a_promoter_died_before_acknowledging_counts_once_online(bus, nats_url, tmp_path):
    """A promoter killed after writing a fetch's evidence and before acknowledging it is handed the
    same samples again: each version's online reward counts them once (it counted them twice)."""
    async with promoting(bus, nats_url, tmp_path, *GATE) as g:
        seen = {(None, 0): [(10**9, 1.0), (10**9 + 1, 0.0)]}  # stream sequences past any the test publishes
        for _ in range(2):  # written, then handed again
            async with g.promoter.decisions.lock:
                await g.promoter._apply(seen)
        assert (await g.registry.get(0)).online_reward() == (2, 0.5)


async def test_samples_a_dead_promoter_held_count_once_and_before_newer_ones(bus, nats_url, tmp_path):
    """A promoter that dies holding samples (fetched, never acknowledged nor handed back): they come
    back only when their ack wait runs out, after newer ones its successor fetches at once; the
    successor applies them first all the same, so each counts once (counted newer first, they were
    passed over as applied already)."""
    turns = await sampled_turns(8)
    async with promoting(bus, nats_url, tmp_path, *GATE, "bus.ack_wait_s=3") as g:
        await g.promoter.stop()
        await publish_samples(bus, turns[:4], 0, 1.0, "held")
        held = await bus.consumer(SAMPLE_SUBJECT, "promote", ack_wait_s=3).fetch(batch=4, timeout_s=5)
        assert len(held) == 4  # and the holder dies
        g.promoter = PromoteLoop(g.config, nats_url)
        await g.promoter.start()
        await publish_samples(bus, turns[4:], 0, 0.0, "new")

        async def all_counted() -> bool:
            return (await g.registry.get(0)).online_reward() == (8, 0.5)

        await until(all_counted)


async def test_a_canary_whose_sessions_fare_no_worse_is_promoted(bus, nats_url, tmp_path):
    turns = await sampled_turns(16)
    async with promoting(bus, nats_url, tmp_path, *CANARY) as p:
        await announce(bus, p.store, 1, parent=0)
        await until(lambda: is_in_state(p.registry, 1, "canary"))
        await publish_samples(bus, turns, 1, 1.0, "c")
        await publish_samples(bus, turns, 0, 1.0, "c")
        await until(lambda: is_in_state(p.registry, 1, "serving"))
        routing = await p.registry.routing()
        assert routing.serving.version == 1 and routing.canary is None and await state_of(p.registry, 0) == "retired"
        assert "no worse" in (await p.registry.get(1)).transitions[-1].reason


async def test_with_tenants_keys_the_gate_reaches_its_evaluation_server(bus, nats_url, tmp_path):
    """Tenants with keys (none in `serve.api_keys`) and an admin key: the gate loads and asks its
    versions with the admin key, so a version that answers like the serving one serves (it used
    to send the first of `serve.api_keys`, none here: every evaluation was a 401)."""
    keys = ("serve.admin_key=root", "tenants={acme: {keys: [acme-key]}}")
    async with promoting(bus, nats_url, tmp_path, *GATE, *keys) as g:
        await announce(bus, g.store, 1, parent=0)
        await until(lambda: is_in_state(g.registry, 1, "serving"))
