"""make run's configuration with a promotion gate that rejects every version: the loop goes on."""

import asyncio

from flywheel.bus import Bus
from flywheel.config import load_config
from flywheel.deploy.deployment import Deployment
from flywheel.versions.registry import Registry

from waiting import until_sync

ETA = 2


def test_a_gate_that_rejects_every_version_does_not_stall_the_loop(ray_session, tmp_path):
    """make run's configuration with a gate no trained version passes (KL to the serving version
    at most 1e-9 nats): each rejection sends the trainer back to the serving version, and the
    loop goes on. It used to stop for good at v3: the samples the abandoned versions were trained
    on still counted against the rollout's admission bound, and the trainer waited for samples
    the driver would not admit. And no version the trainer abandoned may serve (one trained from
    a rejected version, before the trainer heard, was evaluated and served), nor a version the
    trainer went on with be abandoned by a directive that came late (every sample of that
    serving version was then dropped)."""
    config = load_config("configs/local.yaml", [f"run_dir={tmp_path}", "serve.port=0", f"rollout.max_head_offpolicyness={ETA}",
                                                        "promotion.gate.guards.max_kl=1e-9"])
    with Deployment(config) as deployment:
        stats = until_sync(lambda: (s := deployment.stats())["train"].get("version", 0) >= 3 * (ETA + 1) and s,
                           timeout_s=120, poll_s=1.0)
        versions = asyncio.run(registered(deployment.bus_url))
    rejected = [v for v in versions if v.state == "rejected"]
    assert len(rejected) >= ETA + 1 and stats["train"]["abandoned_dropped"] == 0
    assert all(v.gate is None for v in rejected if v.transitions[-1].by == "lineage")  # never evaluated
    assert stats["rollout"]["accepted"] >= 3 * (ETA + 1) * config.train.batch_size


async def registered(bus_url: str) -> list:
    bus = await Bus.connect(bus_url)
    try:
        return await (await Registry.open(bus)).versions()
    finally:
        await bus.close()
