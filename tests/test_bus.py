"""The bus against a real nats-server: durability, redelivery, dedup, malformed input, tail."""

import asyncio
import json
import subprocess

import nats
import psutil
import pytest
from nats.js.errors import APIError, NoStreamResponseError

from flywheel.bus import (
    SESSION_EVENT_SUBJECT,
    TRAFFIC_SUBJECTS,
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    WEIGHTS_SUBJECT,
    Bus,
    EmbeddedNats,
    Sample,
    SessionEvent,
    Trajectory,
    WeightUpdate,
    read_bus_url,
    start_bus,
)
from flywheel.bus.acks import PublishAcks
from flywheel.bus.client import HAND_BACK_S
from flywheel.bus.pull import PullRefused
from flywheel.cli import command
from flywheel.cli.tail import resolve_subject
from flywheel.runtime import cancel_and_wait, repeat

from factories import make_turn
from waiting import until


def event(i: int) -> SessionEvent:
    return SessionEvent(id=f"e{i}", session_id=f"s{i}", kind="end")


async def pull_requests_waiting(bus: Bus, durable: str) -> int:
    """How many pull requests the TRAFFIC consumer `durable` holds open at the server."""
    return (await bus.js.consumer_info("TRAFFIC", durable)).num_waiting


def test_embedded_server_starts_stops_and_keeps_data(tmp_path):
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    assert url.startswith("nats://127.0.0.1:")
    pid = server.pid
    assert psutil.pid_exists(pid)
    server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "nats" / "jetstream").is_dir()


def test_start_bus_writes_the_url_for_operators(tmp_path):
    url, server = start_bus("embedded", tmp_path)
    try:
        assert read_bus_url(tmp_path) == url
    finally:
        server.stop()
    assert start_bus("nats://example:4222", tmp_path / "b") == ("nats://example:4222", None)
    with pytest.raises(FileNotFoundError, match="bus.url"):
        read_bus_url(tmp_path / "nowhere")


async def test_records_are_fetched_in_publish_order_and_once_acknowledged_never_again(bus):
    for i in range(5):
        await bus.publish(SESSION_EVENT_SUBJECT, event(i))
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "t")
    got = await consumer.fetch(batch=10, timeout_s=1)
    assert [d.record.id for d in got] == [f"e{i}" for i in range(5)]
    for d in got:
        await d.ack()
    assert await consumer.fetch(batch=10, timeout_s=0.2) == []


async def test_a_record_published_again_under_its_id_is_dropped(bus):
    for i in (0, 1, 0):
        await bus.publish(SESSION_EVENT_SUBJECT, event(i))  # the second e0: the same id, dropped by JetStream
    got = await bus.consumer(TRAFFIC_SUBJECTS, "t").fetch(batch=10, timeout_s=1)
    assert [d.record.id for d in got] == ["e0", "e1"]


async def test_publish_rejects_the_wrong_record_type(bus):
    with pytest.raises(TypeError, match="carries Turn"):
        await bus.publish(TURN_SUBJECT, event(1))


async def test_unacked_records_are_redelivered_to_a_restarted_durable_consumer(nats_url):
    first = await Bus.connect(nats_url)
    await first.publish(TURN_SUBJECT, make_turn(id="a"))
    await first.publish(TURN_SUBJECT, make_turn(id="b"))
    consumer = first.consumer(TRAFFIC_SUBJECTS, "collect", ack_wait_s=1.0)
    got = await consumer.fetch(timeout_s=1)
    await got[0].ack()  # "b" is never acked: the consumer "dies" holding it
    await first.close()

    second = await Bus.connect(nats_url)
    resumed = second.consumer(TRAFFIC_SUBJECTS, "collect", ack_wait_s=1.0)
    redelivered = await until(lambda: resumed.fetch(timeout_s=2))  # once b's ack wait has run out
    assert [d.record.id for d in redelivered] == ["b"]
    await second.close()


async def test_malformed_messages_are_terminated_not_fatal(bus):
    await bus.js.publish(TURN_SUBJECT, b'{"id": "broken"}')
    await bus.publish(TURN_SUBJECT, make_turn(id="good"))
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "t")
    got = await consumer.fetch(timeout_s=1)
    assert [d.record.id for d in got] == ["good"]
    assert consumer.malformed == 1


async def test_follow_starts_from_the_newest_record(bus):
    assert await bus.last(WEIGHTS_SUBJECT) is None
    for v in (1, 2):
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"w{v}", version=v, path=f"/w/v{v}", step=v))
    assert (await bus.last(WEIGHTS_SUBJECT)).version == 2
    updates = bus.follow(WEIGHTS_SUBJECT)
    assert (await anext(updates)).version == 2
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w3", version=3, path="/w/v3", step=3))
    assert (await asyncio.wait_for(anext(updates), 5)).version == 3
    await updates.aclose()


async def test_tail_prints_json_lines(bus, nats_url):
    for i in range(3):
        await bus.publish(SESSION_EVENT_SUBJECT, event(i))
    await bus.publish(TURN_SUBJECT, make_turn(id="t9"))
    proc = await asyncio.create_subprocess_exec(
        *command("tail", "events", f"bus.url={nats_url}"), stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0
    assert [line["id"] for line in lines] == ["e0", "e1", "e2"]

    proc = await asyncio.create_subprocess_exec(
        *command("tail", "TRAFFIC", f"bus.url={nats_url}"), "-n", "4", stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert [json.loads(line)["id"] for line in out.decode().splitlines()] == ["e0", "e1", "e2", "t9"]


def test_tail_rejects_unknown_names():
    assert resolve_subject("samples") == "flywheel.samples"
    assert resolve_subject("TRAFFIC") == "flywheel.traffic.>"
    with pytest.raises(ValueError, match="accepted"):
        resolve_subject("nonsense")
    proc = subprocess.run(command("tail", "nonsense", "bus.url=nats://x"), capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown stream or subject" in proc.stderr


async def test_publish_all_pipelines_and_reports_each_record(bus):
    big = make_turn(id="big", messages=[{"role": "user", "content": "x" * (bus.nc.max_payload + 1)}])
    records = [make_turn(id="a"), big, make_turn(id="b"), make_turn(id="a")]
    errors = await bus.publish_all(TURN_SUBJECT, records)
    assert errors == [None, None, None, None]
    got = await bus.consumer(TRAFFIC_SUBJECTS, "t").fetch(batch=10, timeout_s=1)
    assert [d.record.id for d in got] == ["a", "big", "b"]  # the repeat of "a" was dropped as a duplicate
    assert got[1].record == big  # larger than a NATS message: carried whole (flywheel/bus/large.py)
    assert bus.publishes_in_flight == 0


async def test_a_jetstream_error_fails_its_publish_without_leaking(bus):
    acks = PublishAcks(bus.nc)
    future = await acks.send("no.stream.here", b"x", headers={})
    with pytest.raises(NoStreamResponseError):
        await asyncio.wait_for(future, 5)
    refused = await acks.send(TURN_SUBJECT, b"x", headers={"Nats-Expected-Stream": "ANOTHER"})
    with pytest.raises(APIError, match="expected stream"):
        await asyncio.wait_for(refused, 5)
    await until(lambda: acks.outstanding == 0, timeout_s=5)


async def test_publish_all_times_out_when_the_server_is_gone(nats_server):
    bus = await Bus.connect(nats_server.url)
    nats_server.stop()
    errors = await bus.publish_all(SESSION_EVENT_SUBJECT, [event(1), event(2)], timeout_s=0.5)
    assert all(isinstance(e, (TimeoutError, ConnectionError, nats.errors.Error)) for e in errors), errors
    await until(lambda: bus.publishes_in_flight == 0, timeout_s=5)  # once the given-up futures' callbacks ran
    await bus.close()


async def test_fetch_waits_for_the_first_record_then_takes_what_is_there(bus):
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "t")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await consumer.fetch(batch=10, timeout_s=0.3) == []
    assert loop.time() - started >= 0.25  # waited, and was ended by the server's expiry
    waiting = asyncio.create_task(consumer.fetch(batch=10, timeout_s=30))
    await until(lambda: pull_requests_waiting(bus, "t"))
    started = loop.time()
    await bus.publish(SESSION_EVENT_SUBJECT, event(1))
    assert [d.record.id for d in await waiting] == ["e1"]
    assert loop.time() - started < 5  # answered on arrival, not at the 30 s expiry
    await bus.publish_all(SESSION_EVENT_SUBJECT, [event(i) for i in range(2, 9)])
    assert [d.record.id for d in await consumer.fetch(batch=5, timeout_s=1)] == [f"e{i}" for i in range(2, 7)]
    assert [d.record.id for d in await consumer.fetch(batch=5, timeout_s=1)] == ["e7", "e8"]


async def test_fetch_from_a_deleted_consumer_is_refused(bus):
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "t")
    assert await consumer.fetch(timeout_s=0.1) == []
    await bus.js.delete_consumer("TRAFFIC", "t")
    with pytest.raises(PullRefused):
        await consumer.fetch(timeout_s=1)


async def test_resolve_attaches_the_referred_trajectory_or_says_it_cannot(bus):
    trajectory = Trajectory(id="s#1", session_id="s", segments=[], turns=[make_turn()], close_reason="done")
    await bus.publish(TRAJECTORY_SUBJECT, trajectory)
    seq = (await bus.consumer(TRAJECTORY_SUBJECT, "t").fetch(timeout_s=1))[0].stream_seq
    sample = Sample(id="s#1", trajectory_seq=seq, reward=1.0, judge="rule")
    assert await bus.resolve(sample) and sample.trajectory == trajectory
    assert not await bus.resolve(Sample(id="other#1", trajectory_seq=seq, reward=1.0, judge="rule"))
    assert not await bus.resolve(Sample(id="s#1", trajectory_seq=seq + 100, reward=1.0, judge="rule"))


async def test_repeat_stops_even_when_a_step_swallows_its_cancellation():
    steps = 0

    async def swallowing_step():  # what asyncio.wait_for does on 3.11 when its inner future just finished
        nonlocal steps
        steps += 1
        try:
            await asyncio.sleep(10)  # a step that takes long: it is cancelled meanwhile
        except asyncio.CancelledError:
            pass

    task = asyncio.create_task(repeat(swallowing_step, "test"))
    await until(lambda: steps == 1)  # the step is under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert steps == 1


async def test_cancel_and_wait_ends_a_task_that_lost_its_cancellation():
    """A stop that cancelled its loops once and gathered them waited forever for one that had
    lost the cancellation (a library swallowed it and forgot it was asked): cancelled again, it ends."""
    started = asyncio.Event()

    async def forgetful_loop():
        started.set()
        try:
            await asyncio.sleep(10)  # waits long: it is cancelled meanwhile
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
        while True:  # runs on, as a loop does
            await asyncio.sleep(0.01)

    task = asyncio.create_task(forgetful_loop())
    await until(started.is_set)
    await asyncio.wait_for(cancel_and_wait([task], patience_s=0.1), 5)
    assert task.cancelled()


async def test_a_consumer_hands_back_what_it_holds_at_once(bus):
    """Handed back, a held record is redelivered now, not into the pull request the stopping
    consumer cancelled (JetStream keeps that open until it expires) nor after the ack wait."""
    await bus.publish(SESSION_EVENT_SUBJECT, event(1))
    first = bus.consumer(TRAFFIC_SUBJECTS, "handed", ack_wait_s=30)
    [held] = await first.fetch(timeout_s=5)
    cancelled = asyncio.create_task(first.fetch(timeout_s=20))
    await until(lambda: pull_requests_waiting(bus, "handed"))  # its pull request is open at the server
    cancelled.cancel()
    await first.hand_back([held])
    second = bus.consumer(TRAFFIC_SUBJECTS, "handed", ack_wait_s=30)
    [again] = await second.fetch(timeout_s=5)
    assert again.record.id == "e1"


async def test_handing_back_gives_up_within_its_bound_when_the_server_is_gone(nats_server):
    """With the server away, handing back gives up within HAND_BACK_S and raises nothing."""
    bus = await Bus.connect(nats_server.url)
    await bus.publish(SESSION_EVENT_SUBJECT, event(1))
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "handed", ack_wait_s=30)
    [again] = await consumer.fetch(timeout_s=5)
    nats_server.stop()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await consumer.hand_back([again])
    assert loop.time() - started < HAND_BACK_S + 1
    await bus.close()


async def test_streams_are_asked_for_again_while_jetstream_does_not_answer(bus, monkeypatch):
    """A cluster that lost a member answers no JetStream request until it has a leader again: a
    process starting then (a fault drill's trainer) died of the first timeout; it asks again."""
    refusals, stream_info = [], bus.js.stream_info

    async def not_yet(*args, **kwargs):
        if len(refusals) < 2:
            refusals.append(args)
            raise nats.errors.TimeoutError
        return await stream_info(*args, **kwargs)

    monkeypatch.setattr(bus.js, "stream_info", not_yet)
    await bus.ensure_streams()
    assert len(refusals) == 2 and (await stream_info("SAMPLES")).config.name == "SAMPLES"
