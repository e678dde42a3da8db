"""The trainer under promotion, against a real registry on a real bus: it keeps pace with the
version serving everyone, continues from the version a directive names (its weights, a fresh
optimizer), drops samples from the versions it abandons, counts staleness in updates that were
not abandoned, passes over a directive about a line it already left, keeps the served
versions in the weight store, and its ledger's lineage leaves out the abandoned versions' steps."""

import asyncio

import torch

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.train.ledger import lineage
from flywheel.train.loop import TrainLoop
from flywheel.versions.records import Arm, Routing, TrainerDirective
from flywheel.versions.registry import Registry

from factories import sample_of, sampled_turns
from waiting import until


async def test_pace_directives_abandoned_versions_and_protection(bus, nats_url, tmp_path):
    turns = await sampled_turns(8)
    config = load_config(None, [f"run_dir={tmp_path}", "train.batch_size=1", "rollout.max_head_offpolicyness=1",
                                "promotion.mode=gate", "promotion.gate.suites=[{name: d, env: digits}]", "train.keep_versions=1",
                                "actor.optimizer.lr=0.01"])
    registry = await Registry.open(bus)
    await registry.set_routing(Routing(id="r0", serving=Arm(version=0, path=None)))
    loop = TrainLoop(config, nats_url)
    await loop.start()
    announcements = bus.follow(WEIGHTS_SUBJECT, from_last=False)
    try:
        for i in range(4):
            await bus.publish(SAMPLE_SUBJECT, sample_of(turns[i], float(i % 2), version=0))
        assert (await asyncio.wait_for(anext(announcements), 60)).version == 1
        await until(lambda: loop.buffer == 3)  # v2 would be two updates ahead of v0 with η = 1: the others wait
        assert loop.version == 1 and loop.stats()["samples"] == 1

        # v1 serves: one more step (its v0 sample is one update old), then the trainer waits again.
        await registry.set_routing(Routing(id="r1", serving=Arm(version=1, path=str(tmp_path / "weights" / "v1"))))
        assert (await asyncio.wait_for(anext(announcements), 60)).version == 2
        await until(lambda: loop.buffer == 2)
        # v2 serves: the waiting v0 samples are now 2 updates old (stale); a v2 sample is trained.
        await registry.set_routing(Routing(id="r2", serving=Arm(version=2, path=str(tmp_path / "weights" / "v2"))))
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[4], 1.0, version=2))
        third = await asyncio.wait_for(anext(announcements), 60)
        assert third.version == 3 and loop.stats()["stale_dropped"] == 2
        assert (tmp_path / "weights" / "v2").exists() and not (tmp_path / "weights" / "v1").exists()  # v2 serves: kept

        # Rolled back to v0: the trainer continues from v0's weights with a fresh optimizer; v1..v3 are abandoned.
        base, _ = load_model("tiny")
        assert loop.trainer.optimizer.state
        await registry.set_routing(Routing(id="r3", serving=Arm(version=0, path=None)))
        await registry.set_directive(TrainerDirective(id="d1", version=0, path=None, abandon_after=0, reason="v3 rolled back", rejected=3))
        await until(lambda: loop.promotion.abandoned == [1, 2, 3])
        assert all(torch.equal(a, b) for a, b in zip(loop.trainer.model.state_dict().values(), base.state_dict().values()))
        assert not loop.trainer.optimizer.state and loop.staleness(0) == 0  # v0's weights: 0 updates from v0
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[5], 1.0, version=2))  # sampled by the abandoned v2
        await until(lambda: loop.stats()["abandoned_dropped"] == 1)
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[6], 1.0, version=0))
        fourth = await asyncio.wait_for(anext(announcements), 60)
        assert (fourth.version, fourth.parent) == (4, 0) and loop.staleness(0) == 1
        assert loop.stats()["staleness_seen"] == {0: 3, 1: 1}  # the v0 sample after the rollback: 0 updates old, not 3

        # A directive that comes late, about the line the trainer was sent back from (v3 again: a
        # candidate of that line rejected by lineage), is passed over: v4 is not abandoned, and v4
        # serves and is trained on.
        await registry.set_directive(TrainerDirective(id="d2", version=0, path=None, abandon_after=0, reason="v3 rejected", rejected=3))
        await until(lambda: "d2" in loop.promotion.applied)
        assert loop.promotion.abandoned == [1, 2, 3] and loop.staleness(0) == 1
        await registry.set_routing(Routing(id="r4", serving=Arm(version=4, path=str(tmp_path / "weights" / "v4"))))
        await bus.publish(SAMPLE_SUBJECT, sample_of(turns[7], 1.0, version=4))
        fifth = await asyncio.wait_for(anext(announcements), 60)
        assert (fifth.version, fifth.parent) == (5, 4) and loop.stats()["abandoned_dropped"] == 1
        assert [step["version"] for step in lineage(tmp_path / "trained.jsonl")] == [4, 5]  # v1..v3's steps lead nowhere
    finally:
        await announcements.aclose()
        await loop.stop()
