"""The bus against a real nats-server: durability, redelivery, dedup, malformed input, tail."""

import asyncio
import json
import subprocess
import sys

import psutil
import pytest

from bus import (
    SESSION_EVENT_SUBJECT,
    TRAFFIC_SUBJECTS,
    TURN_SUBJECT,
    WEIGHTS_SUBJECT,
    Bus,
    EmbeddedNats,
    SessionEvent,
    WeightUpdate,
    read_bus_url,
    start_bus,
)
from bus.tail import resolve_subject
from tests.test_records import make_turn


def event(i: int) -> SessionEvent:
    return SessionEvent(id=f"e{i}", session_id=f"s{i}", kind="end")


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


async def test_publish_fetch_ack_in_order_and_dedup(bus):
    for i in range(5):
        await bus.publish(SESSION_EVENT_SUBJECT, event(i))
    await bus.publish(SESSION_EVENT_SUBJECT, event(0))  # same id: dropped by JetStream
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "t")
    got = await consumer.fetch(batch=10, timeout_s=1)
    assert [d.record.id for d in got] == [f"e{i}" for i in range(5)]
    for d in got:
        await d.ack()
    assert await consumer.fetch(batch=10, timeout_s=0.2) == []


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
    redelivered = []
    while not redelivered:
        redelivered = await resumed.fetch(timeout_s=2)
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
        sys.executable, "-m", "bus.tail", "events", "--url", nats_url, stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0
    assert [line["id"] for line in lines] == ["e0", "e1", "e2"]

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bus.tail", "TRAFFIC", "--url", nats_url, "-n", "4", stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert [json.loads(line)["id"] for line in out.decode().splitlines()] == ["e0", "e1", "e2", "t9"]


def test_tail_rejects_unknown_names():
    assert resolve_subject("samples") == "flywheel.samples"
    assert resolve_subject("TRAFFIC") == "flywheel.traffic.>"
    with pytest.raises(ValueError, match="accepted"):
        resolve_subject("nonsense")
    proc = subprocess.run([sys.executable, "-m", "bus.tail", "nonsense", "--url", "nats://x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown stream or subject" in proc.stderr
