"""The bus on a JetStream cluster of three real nats-servers (`flywheel.bus.cluster`), and publishes that
outlive the server they were sent to."""

import asyncio

import nats.errors

from flywheel.bus import (
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    Bus,
    EmbeddedNats,
    Sample,
    Trajectory,
)
from flywheel.bus.cluster import LocalNatsCluster
from flywheel.bus.large import BUCKET
from flywheel.bus.pull import PullRefused
from flywheel.ports import free_port

from factories import freeze, make_turn
from waiting import until


async def eventually(step, timeout_s: float = 60):
    """`await step()`, retried as the loops retry a failed step (`flywheel.runtime.repeat`) until
    it succeeds: while a stream elects a new leader, its requests are refused or go unanswered for
    a few seconds. Fails the test after `timeout_s`, from the step's last error."""
    results, errors = [], []

    async def succeeded() -> bool:
        try:
            results.append(await step())
        except (nats.errors.Error, PullRefused) as error:
            errors.append(error)
            return False
        return True

    try:
        await until(succeeded, timeout_s, poll_s=0.1)
    except AssertionError as not_reached:
        raise not_reached from errors[-1] if errors else None
    return results[-1]


def trajectory(i: int) -> Trajectory:
    return Trajectory(id=f"s{i}#1", session_id=f"s{i}", segments=[], turns=[make_turn()], close_reason="done")


async def test_a_three_server_bus_keeps_three_copies_and_serves_through_the_loss_of_any_member(tmp_path):
    with LocalNatsCluster(tmp_path / "cluster") as cluster:
        assert len(cluster.url.split(",")) == 3
        bus = await Bus.connect(cluster.url, name="test", replicas=3)
        try:
            for stream in ("TRAFFIC", "TRAJECTORIES", "SAMPLES", "UNSCORED", "WEIGHTS"):
                assert (await bus.js.stream_info(stream)).config.num_replicas == 3
            await bus.large.put(TRAJECTORY_SUBJECT, "x", b"payload")
            assert (await bus.js.stream_info(f"OBJ_{BUCKET}")).config.num_replicas == 3

            consumer = bus.consumer(TRAJECTORY_SUBJECT, "t")
            await bus.publish(TRAJECTORY_SUBJECT, trajectory(1))
            connected = bus.nc.connected_url.port
            victim = next(i for i, m in enumerate(cluster.members) if m.port == connected)
            cluster.kill(victim)  # the member this client talks to
            await eventually(lambda: bus.publish(TRAJECTORY_SUBJECT, trajectory(2)))
            assert bus.nc.connected_url.port != connected
            got = []

            async def both_read() -> bool:
                for delivery in await eventually(lambda: consumer.fetch(timeout_s=1)):
                    got.append(delivery)
                    await delivery.ack()
                return len(got) >= 2

            await until(both_read)
            assert [d.record.id for d in got] == ["s1#1", "s2#1"]

            cluster.restart(victim)
            cluster.wait_healthy(victim)
            for delivery in got:  # whichever replica answers, a sample finds its trajectory
                sample = Sample(id=delivery.record.id, trajectory_seq=delivery.stream_seq, reward=1.0, judge="rule")
                assert await bus.resolve(sample) and sample.trajectory == delivery.record
        finally:
            await bus.close()


async def test_a_publish_lost_with_the_server_that_took_it_is_sent_again_on_reconnect(tmp_path):
    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    server.start()
    bus = await Bus.connect(server.url, name="test")
    try:
        freeze(server.pid)  # takes the bytes into its socket, never reads them
        publish = asyncio.create_task(bus.publish(TURN_SUBJECT, make_turn(), timeout_s=60))
        await until(lambda: bus.publishes_in_flight > 0 or publish.done(), timeout_s=10)
        assert not publish.done(), "the frozen server acknowledged the publish"
        server.kill()  # dies with the message unread
        server.start()
        await asyncio.wait_for(publish, 30)  # acknowledged after the reconnect, not timed out at 60 s
        assert (await bus.js.stream_info("TRAFFIC")).state.messages == 1
    finally:
        await bus.close()
        server.stop()
