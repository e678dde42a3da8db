"""The recorder against a real nats-server: records made during a bus outage, or while the queue
is full, go to spill files and are published in order exactly once; a new recorder replays what
a stopped one left on disk."""

import asyncio
import os

import pytest

from flywheel.bus import TRAFFIC_SUBJECTS, TURN_SUBJECT, Bus, EmbeddedNats
from flywheel.serve.recorder import Recorder, RecordLost

from bus_reading import delivered
from factories import make_turn
from waiting import until


class RestartableNats:
    """A nats-server that can go away and come back on the same port with the same data."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.server = EmbeddedNats(data_dir)
        self.url = self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server = EmbeddedNats(self.data_dir, port=int(self.url.rsplit(":", 1)[1]))
        assert self.server.start() == self.url


@pytest.fixture
def outage_nats(tmp_path):
    nats = RestartableNats(tmp_path / "nats")
    yield nats
    nats.stop()


async def stream_ids(bus: Bus, n: int) -> list[str]:
    """The ids of everything on the traffic stream, read until n arrived and then once more."""
    consumer = bus.consumer(TRAFFIC_SUBJECTS, "check")
    ids = [d.record.id for d in await delivered(consumer, n, timeout_s=10, fetch_s=0.2)]
    return ids + [d.record.id for d in await consumer.fetch(timeout_s=0.3)]


def spill_files(spill_dir) -> list:
    return sorted(spill_dir.glob("*.jsonl")) if spill_dir.exists() else []


async def test_records_made_during_a_bus_outage_are_spilled_and_published_in_order(outage_nats, tmp_path):
    spill_dir = tmp_path / "spill"
    bus = await Bus.connect(outage_nats.url, name="serve")
    recorder = Recorder(bus, maxsize=1000, spill_dir=spill_dir)
    publisher = asyncio.create_task(recorder.run())
    assert recorder.record(TURN_SUBJECT, make_turn(id="before"))
    await recorder.flush(timeout_s=10)
    assert recorder.spilled == 0 and recorder.published == 1

    outage_nats.stop()
    await until(lambda: not bus.nc.is_connected)
    assert all(recorder.record(TURN_SUBJECT, make_turn(id=f"t{i}", turn_index=i)) for i in range(200))
    assert recorder.spilled == 200 and recorder.pending == 200 and recorder.dropped == 0
    assert spill_files(spill_dir)

    outage_nats.restart()
    await recorder.flush(timeout_s=30)
    assert spill_files(spill_dir) == [] and recorder.pending == 0 and recorder.published == 201
    assert await stream_ids(bus, 201) == ["before"] + [f"t{i}" for i in range(200)]
    publisher.cancel()
    await asyncio.gather(publisher, return_exceptions=True)
    await bus.close()


async def test_records_spilled_together_share_one_fsync_and_durable_waits_for_it(bus, tmp_path, monkeypatch):
    """A group commit: the 200 records that reach the spill file in one turn of the event loop
    cost one fsync (one each stalled the event loop 1.7 s in all on a loaded machine), and no
    `durable` caller hears back before that fsync."""
    recorder = Recorder(bus, maxsize=1, spill_dir=tmp_path / "spill")  # no publisher: the queue fills
    assert recorder.record(TURN_SUBJECT, make_turn(id="queued"))
    done_at_fsync, fsync = [], os.fsync

    def counted_fsync(fd: int) -> None:
        fsync(fd)
        done_at_fsync.append(sum(waiting.done() for waiting in waiting_callers))

    monkeypatch.setattr(os, "fsync", counted_fsync)
    waiting_callers = [asyncio.create_task(recorder.durable(TURN_SUBJECT, make_turn(id=f"t{i}"))) for i in range(200)]
    await asyncio.gather(*waiting_callers)
    # The queue moved to a new file (its fsync and its directory's), then the 200 records' one.
    assert done_at_fsync == [0, 0, 0], done_at_fsync
    assert recorder.spilled == 201 and recorder.dropped == 0 and len(spill_files(tmp_path / "spill")) == 1


async def test_a_full_queue_spills_instead_of_dropping(bus, tmp_path):
    spill_dir = tmp_path / "spill"
    recorder = Recorder(bus, maxsize=4, spill_dir=spill_dir)
    assert all(recorder.record(TURN_SUBJECT, make_turn(id=f"t{i}")) for i in range(30))
    assert recorder.dropped == 0 and recorder.spilled == 30 and recorder.pending == 30
    publisher = asyncio.create_task(recorder.run())
    await recorder.flush(timeout_s=10)
    assert recorder.record(TURN_SUBJECT, make_turn(id="after"))  # the disk is drained: back to memory
    await recorder.flush(timeout_s=10)
    assert recorder.spilled == 30 and recorder.published == 31 and spill_files(spill_dir) == []
    assert await stream_ids(bus, 31) == [f"t{i}" for i in range(30)] + ["after"]
    publisher.cancel()
    await asyncio.gather(publisher, return_exceptions=True)

    without_spill = Recorder(bus, maxsize=4)
    accepted = [without_spill.record(TURN_SUBJECT, make_turn(id=f"u{i}")) for i in range(30)]
    assert accepted.count(True) == 4 and without_spill.dropped == 26


async def test_a_record_larger_than_a_nats_message_is_carried_whole_in_order(bus, tmp_path):
    recorder = Recorder(bus, maxsize=10, spill_dir=tmp_path / "spill")
    huge = make_turn(id="huge", messages=[{"role": "user", "content": "x" * (3 * bus.nc.max_payload)}])
    assert recorder.record(TURN_SUBJECT, make_turn(id="first"))
    assert recorder.record(TURN_SUBJECT, huge)
    assert recorder.record(TURN_SUBJECT, make_turn(id="last"))
    publisher = asyncio.create_task(recorder.run())
    await recorder.flush(timeout_s=10)
    assert recorder.dropped == 0 and recorder.published == 3
    assert await stream_ids(bus, 3) == ["first", "huge", "last"]
    [delivery] = [d for d in await bus.consumer(TURN_SUBJECT, "check-huge").fetch(batch=3) if d.record.id == "huge"]
    assert delivery.record.messages == huge.messages
    publisher.cancel()
    await asyncio.gather(publisher, return_exceptions=True)


async def test_a_new_recorder_replays_what_a_stopped_one_left_on_disk(outage_nats, tmp_path):
    spill_dir = tmp_path / "spill"
    old_bus = await Bus.connect(outage_nats.url, name="old")
    old = Recorder(old_bus, maxsize=100, spill_dir=spill_dir)
    publisher = asyncio.create_task(old.run())
    outage_nats.stop()
    await until(lambda: not old_bus.nc.is_connected)
    assert all(old.record(TURN_SUBJECT, make_turn(id=f"a{i}")) for i in range(10))
    publisher.cancel()  # the old process stops during the outage
    await asyncio.gather(publisher, return_exceptions=True)
    assert old.record(TURN_SUBJECT, make_turn(id="a10"))  # after its publisher stopped: to disk too
    await old_bus.close()
    assert spill_files(spill_dir) and old.published == 0

    outage_nats.restart()
    bus = await Bus.connect(outage_nats.url, name="new")
    new = Recorder(bus, maxsize=100, spill_dir=spill_dir)
    assert new.pending == 11
    assert all(new.record(TURN_SUBJECT, make_turn(id=f"b{i}")) for i in range(5))
    publisher = asyncio.create_task(new.run())
    await new.flush(timeout_s=30)
    assert spill_files(spill_dir) == [] and new.published == 16
    assert await stream_ids(bus, 16) == [f"a{i}" for i in range(11)] + [f"b{i}" for i in range(5)]
    publisher.cancel()
    await asyncio.gather(publisher, return_exceptions=True)
    await bus.close()


async def test_a_record_that_cannot_be_encoded_is_refused_alone(bus, tmp_path):
    """A lone surrogate (or an int over 64 bits) cannot go on the bus: that record is refused
    and counted; it never blocks the queue or a spill of the records around it."""
    recorder = Recorder(bus, maxsize=10, spill_dir=tmp_path / "spill")
    publisher = asyncio.create_task(recorder.run())
    bad = make_turn(id="bad", messages=[{"role": "user", "content": "\ud800"}])
    huge = make_turn(id="huge", sampling={"sampling_seed": 2**70})
    with pytest.raises(RecordLost, match="cannot be encoded"):
        await recorder.durable(TURN_SUBJECT, bad)
    assert not recorder.record(TURN_SUBJECT, huge)
    await recorder.durable(TURN_SUBJECT, make_turn(id="good"))
    assert recorder.dropped == 2 and recorder.published == 1
    assert await stream_ids(bus, 1) == ["good"]
    publisher.cancel()
    await asyncio.gather(publisher, return_exceptions=True)
