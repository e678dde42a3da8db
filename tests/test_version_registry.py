"""The version registry on a real NATS server: versions, routing and the trainer's directive
written by one connection are read by another (a promoter that died and came back), gateways
follow routing changes, only the moves of flywheel/promote/states.py are allowed, and the versions above
the serving one that the trainer abandoned are counted (the rollout's admission bound)."""

import asyncio

import pytest

from flywheel.bus import Bus
from flywheel.bus.streams import ROUTING_SUBJECT
from flywheel.promote.states import AUTOMATIC, IllegalTransition, move
from flywheel.versions.records import (
    Arm,
    Routing,
    TrainerDirective,
    VersionEntry,
    abandoned_above,
)
from flywheel.versions.registry import Registry


def entry(version: int, state="candidate") -> VersionEntry:
    return VersionEntry(id=f"v{version}", version=version, path=f"/store/v{version}", parent=version - 1, state=state)


async def test_what_one_process_wrote_another_reads(nats_url):
    writer = await Bus.connect(nats_url, name="promoter")
    registry = await Registry.open(writer)
    assert await registry.versions() == [] and await registry.routing() is None
    for version in (2, 0, 1):
        await registry.put(entry(version))
    await registry.put(move(await registry.get(1), "evaluating", "the newest candidate", by="promoter"))
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None), canary=Arm(version=1, path="/store/v1"),
                                       canary_share=0.1, reason="v1 passed the gate"))
    await registry.set_directive(TrainerDirective(id="d1", version=0, path=None, abandon_after=0, reason="v1 rolled back"))
    await writer.close()  # the promoter dies

    reader = await Bus.connect(nats_url, name="promoter-again")
    again = await Registry.open(reader)
    assert [e.version for e in await again.versions()] == [0, 1, 2]
    one = await again.get(1)
    assert one.state == "evaluating" and [(t.state, t.by) for t in one.transitions] == [("evaluating", "promoter")]
    routing = await again.routing()
    assert (routing.serving.version, routing.canary.version, routing.canary_share) == (0, 1, 0.1)
    assert (await again.directive()).reason == "v1 rolled back"
    assert await again.get(7) is None
    await reader.close()


async def test_a_gateway_follows_the_newest_routing(bus):
    registry = await Registry.open(bus)
    await registry.set_routing(Routing(id="r1", serving=Arm(version=0, path=None)))
    seen: list[Routing] = []

    async def follow():
        async for routing in bus.follow(ROUTING_SUBJECT, newest_only=True):
            seen.append(routing)
            if routing.serving.version == 3:
                return

    follower = asyncio.create_task(follow())
    await registry.set_routing(Routing(id="r2", serving=Arm(version=3, path="/store/v3")))
    await asyncio.wait_for(follower, 30)
    assert seen[0].serving.version in (0, 3) and seen[-1].serving.version == 3  # from the newest on


@pytest.mark.parametrize("start, target", [(s, t) for s, allowed in AUTOMATIC.items() for t in sorted(allowed)])
def test_each_automatic_move_is_recorded_with_its_reason(start, target):
    moved = move(entry(5, start), target, f"to {target}", by="promoter")
    assert moved.state == target and (moved.transitions[-1].state, moved.transitions[-1].reason) == (target, f"to {target}")


@pytest.mark.parametrize("start, target", [("candidate", "serving"), ("candidate", "canary"), ("rejected", "evaluating"),
                                           ("rolled_back", "canary"), ("retired", "serving"), ("serving", "canary")])
def test_a_move_the_table_does_not_allow_is_refused(start, target):
    with pytest.raises(IllegalTransition, match=f"from {start} to {target}"):
        move(entry(5, start), target, "no", by="promoter")


@pytest.mark.parametrize("start", ["candidate", "rejected", "retired", "rolled_back", "canary"])
def test_an_operator_may_serve_any_version_and_take_back_the_serving_one(start):
    assert move(entry(5, start), "serving", "operator's choice", by="operator").state == "serving"
    assert move(entry(5, "serving"), "rolled_back", "operator's choice", by="operator").state == "rolled_back"


def line(*specs: tuple[int, int, str]) -> list[VersionEntry]:
    """Entries from (version, parent, state)."""
    return [VersionEntry(id=f"v{v}", version=v, path=None, parent=p, state=s) for v, p, s in specs]


def test_the_versions_abandoned_above_the_serving_one():
    # v1 serves; v2 was superseded by v3 before evaluation, v3 is evaluated: both are in play.
    in_play = line((0, -1, "retired"), (1, 0, "serving"), (2, 1, "retired"), (3, 2, "evaluating"))
    assert abandoned_above(in_play, 1) == 0
    # v3 is rejected: the trainer goes back to v1, abandoning v2 (below v3) and v3; v4 from v3 is
    # rejected by lineage, v5 from v1 is the new line.
    rejected = line((1, 0, "serving"), (2, 1, "retired"), (3, 2, "rejected"), (4, 3, "rejected"), (5, 1, "candidate"))
    assert abandoned_above(rejected, 1) == 3
    # A canary from the serving version is in play; after a rollback to v1, v2 (served, then
    # retired) and the rolled-back v3 are abandoned above v1.
    assert abandoned_above(line((1, 0, "serving"), (2, 1, "canary")), 1) == 0
    assert abandoned_above(line((1, 0, "serving"), (2, 1, "retired"), (3, 2, "rolled_back"), (4, 1, "candidate")), 1) == 2
