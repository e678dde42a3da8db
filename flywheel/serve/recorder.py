"""Publishes turn records and session events to the bus, off the response path, losing nothing.

`record()` never blocks and never raises; `durable()` waits until the record is safe: acknowledged
by JetStream, or written and fsync'd to a spill file. The gateway answers a client (a feedback
200, a stream's final `[DONE]`, a whole completion) only after `durable()`, so whatever a client
was told is recorded survives a kill -9 of the gateway. Normally a record goes on a bounded in-memory
queue that one background task (`run`) publishes in order, so a session's feedback follows the
turns recorded before it. With a spill directory, the recorder switches to disk when the queue
is full, when the bus connection is down, or when a publish fails: what is queued moves to the
end of an append-only JSON-lines spill file, and every later record is appended after it, until
the publisher has replayed all spill files in order and JetStream has acknowledged each record.
The records spilled in one turn of the event loop share one fsync (a group commit), after which
their `durable()` callers hear back: `record()` itself only writes.
A spill file is deleted only after all its records are acknowledged; spill files left by a
previous process are replayed before anything new. Order is kept throughout. A record that
was in flight when the switch happened may be published twice: JetStream drops the repeat by
its `Nats-Msg-Id` inside its duplicate window, and consumers deduplicate by id beyond it.

Without a spill directory a full queue drops the record (counted in `dropped`) and a failed
publish is retried with backoff until the bus answers. Records of any size are published whole
(`flywheel/bus/large.py`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from flywheel.bus import Bus, Record, decode, encode
from flywheel.bus.streams import carried_by, record_type
from flywheel.models.cache import fsync_directory

log = logging.getLogger(__name__)

SPILL_FILE_BYTES = 64 * 1024 * 1024
"""A spill file is closed past this size and a new one started, so that the disk space of an
outage's backlog is returned file by file as it drains."""


class SpillLine(msgspec.Struct):
    """One line of a spill file: the subject and the record as encoded on the bus."""

    subject: str
    record: msgspec.Raw


_LINE_DECODER = msgspec.json.Decoder(SpillLine)


def _sequence(path: Path) -> int:
    return int(path.stem.removeprefix("spill-"))


class SpillLog:
    """Numbered append-only spill files in one directory, read back oldest first."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._files = collections.deque(sorted(directory.glob("spill-*.jsonl"), key=_sequence))
        self.backlog = 0
        """Records in the files not yet acknowledged (the whole of files left by a previous process)."""
        for path in self._files:
            with path.open("rb") as f:
                self.backlog += sum(1 for _ in f)
        self._next = _sequence(self._files[-1]) + 1 if self._files else 0
        self._writer: BinaryIO | None = None
        self._dirty = False
        """Written since the last fsync."""
        self._unsynced: list[asyncio.Future[None]] = []
        """Who waits for what was written since the last fsync to be on disk."""

    @property
    def empty(self) -> bool:
        return not self._files

    def append(self, entries: list[tuple[str, Record]], sync: bool = True,
               waiting: list[asyncio.Future[None]] | None = None) -> None:
        """Write records at the end, in order. With `sync` they are fsync'd before this returns;
        without, at the next `sync` (or `close`), which settles `waiting` once they are on disk."""
        data = b"".join(msgspec.json.encode(SpillLine(s, msgspec.Raw(encode(r, "json")))) + b"\n" for s, r in entries)
        if self._writer is None or self._writer.tell() > SPILL_FILE_BYTES:
            self.close()
            path = self.directory / f"spill-{self._next:012d}.jsonl"
            self._next += 1
            self._writer = path.open("ab")
            self._files.append(path)
            fsync_directory(self.directory)  # the new file's name is durable too
        self._writer.write(data)
        self._writer.flush()
        self.backlog += len(entries)
        self._unsynced.extend(waiting or ())
        self._dirty = True
        if sync:
            self.sync()

    def sync(self) -> None:
        """fsync what was written since the last sync and settle whoever waits on it (with
        `RecordLost` if the disk refuses, and the error raised)."""
        waiting, self._unsynced = self._unsynced, []
        try:
            if self._dirty and self._writer is not None:
                os.fsync(self._writer.fileno())
            self._dirty = False
        except OSError as exc:
            log.error("fsync of %s failed: %s", self.directory, exc)
            for done in waiting:
                _settle(done, RecordLost(f"the spill file in {self.directory} could not be synced: {exc}"))
            raise
        for done in waiting:
            _settle(done)

    def oldest(self) -> Path | None:
        """The oldest file, closed for writing (appends after this go to a new file)."""
        if len(self._files) == 1:
            self.close()
        return self._files[0] if self._files else None

    def read(self, path: Path) -> Iterator[tuple[str, Record] | None]:
        """The records of a file in order; None for a line that cannot be read (logged)."""
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    entry = _LINE_DECODER.decode(line)
                    yield entry.subject, decode(entry.record, carried_by(entry.subject), "json")
                except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
                    log.error("spill file %s line %d cannot be read (%s); skipped", path, number, exc)
                    yield None

    def remove(self, path: Path) -> None:
        """Delete a file whose records are all acknowledged."""
        self._files.remove(path)
        path.unlink()

    def close(self) -> None:
        """Sync and close the file being written (an fsync that fails was logged and its waiters told)."""
        if self._writer is not None:
            with contextlib.suppress(OSError):
                self.sync()
            self._writer.close()
            self._writer = None


class RecordLost(RuntimeError):
    """A record could be neither published nor saved to disk."""


_Entry = tuple[str, Record, "asyncio.Future[None] | None"]
_UNENCODABLE = (msgspec.MsgspecError, UnicodeError, OverflowError, ValueError, TypeError)
"""What encoding a record with an impossible value raises (a lone surrogate, an int over 64 bits)."""


class Recorder:
    def __init__(self, bus: Bus, maxsize: int = 10_000, spill_dir: Path | None = None):
        self._bus = bus
        self._maxsize = maxsize
        self._queue: collections.deque[_Entry] = collections.deque()
        """The head stays here while it is being published, until it is acknowledged."""
        self._spill = SpillLog(Path(spill_dir)) if spill_dir is not None else None
        self._spilling = self._spill is not None and not self._spill.empty
        """While true, records go to disk and the queue is empty; false only when the disk is."""
        self._moves = 0
        """How often the queue moved to disk (a publish in flight then is the disk's to finish)."""
        self._sync_scheduled = False
        """A group commit's fsync is due at the event loop's next turn (`_sync_soon`)."""
        self._stopped = False
        self._work = asyncio.Event()
        self._drained = asyncio.Event()
        (self._work if self._spilling else self._drained).set()
        self._delay = 0.0
        self.published = 0
        self.dropped = 0
        self.spilled = 0
        self.retries = 0

    @property
    def pending(self) -> int:
        """Records not yet acknowledged by the bus, in memory and on disk."""
        return len(self._queue) + (self._spill.backlog if self._spill is not None else 0)

    def record(self, subject: str, record: Record) -> bool:
        """Hand a record over for publishing; False (and counted in `dropped`) if it is lost."""
        return self._take(subject, record, None)

    async def durable(self, subject: str, record: Record) -> None:
        """Hand a record over and wait until it is durable (acknowledged by JetStream, or
        fsync'd to a spill file); `RecordLost` if it can be neither."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._take(subject, record, done)
        await done

    def _take(self, subject: str, record: Record, done: asyncio.Future[None] | None) -> bool:
        if not isinstance(record, record_type(subject) or ()):
            return self._drop(record, f"{subject} does not carry {type(record).__name__}", done)
        try:  # refused here, one record, rather than failing a publish or spill of many later
            encode(record)
        except _UNENCODABLE as exc:
            return self._drop(record, f"it cannot be encoded ({type(exc).__name__}: {exc})", done)
        if self._spill is not None and (
            self._spilling or self._stopped or len(self._queue) >= self._maxsize or not self._bus.nc.is_connected
        ):
            try:
                self._move_queue_to_disk()
                self._spill.append([(subject, record)], sync=False, waiting=[done] if done is not None else None)
                if self._stopped:
                    self._spill.close()  # no publisher will close it
            except OSError as exc:
                return self._drop(record, f"spill to {self._spill.directory} failed: {exc}", done)
            self.spilled += 1
            self._sync_soon()
        elif len(self._queue) >= self._maxsize:
            return self._drop(record, "queue full", done)
        else:
            self._queue.append((subject, record, done))
        self._drained.clear()
        self._work.set()
        return True

    def _sync_soon(self) -> None:
        """Group commit: the records spilled in one turn of the event loop share one fsync, after
        which their `durable` callers hear back (an fsync a record cost each an outage's
        throughput, and the event loop stalled on every one)."""
        if self._sync_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to come back to: now
            return self._sync()
        self._sync_scheduled = True
        loop.call_soon(self._sync)

    def _sync(self) -> None:
        self._sync_scheduled = False
        assert self._spill is not None
        with contextlib.suppress(OSError):  # logged, and its waiters told, by the spill log
            self._spill.sync()

    def _drop(self, record: Record, reason: str, done: asyncio.Future[None] | None = None) -> bool:
        self.dropped += 1
        log.error("recorder dropped %s %s: %s", type(record).__name__, record.id, reason)
        _settle(done, RecordLost(f"{type(record).__name__} {record.id} was not recorded: {reason}"))
        return False

    def _move_queue_to_disk(self) -> None:
        """Enter spill mode: what is queued (a publish in flight included) goes to disk first."""
        if self._spilling:
            return
        assert self._spill is not None
        moved = list(self._queue)
        if moved:
            self._spill.append([(subject, record) for subject, record, _ in moved])
            self.spilled += len(moved)
            self._queue.clear()
            self._moves += 1
            for _, _, done in moved:
                _settle(done)
        self._spilling = True
        if moved or not self._stopped:  # a clean stop with nothing queued is not news
            log.warning("recorder spilling to %s (%d queued records moved)", self._spill.directory, len(moved))

    async def run(self) -> None:
        """Publish forever; cancel to stop (call `flush` first to drain). On the way out, records
        still queued go to the spill files, and later ones follow them."""
        self._stopped = False
        try:
            while True:
                if self._queue:
                    await self._publish_head()
                elif self._spill is not None and not self._spill.empty:
                    await self._replay(self._spill.oldest())
                else:
                    self._spilling = False
                    self._drained.set()
                    self._work.clear()
                    await self._work.wait()
        finally:
            self._stopped = True
            if self._spill is not None:
                try:
                    self._move_queue_to_disk()
                except OSError:
                    log.exception("could not save %d queued records to %s", len(self._queue), self._spill.directory)
                self._spill.close()
            for _, record, done in self._queue:  # kept in memory (or lost with the process), not durable
                _settle(done, RecordLost(f"{type(record).__name__} {record.id}: the recorder stopped before publishing it"))

    def _published(self, done: asyncio.Future[None] | None = None) -> None:
        self.published += 1
        _settle(done)

    async def _publish_head(self) -> None:
        subject, record, done = self._queue[0]
        moves = self._moves
        try:
            await self._bus.publish(subject, record)
        except Exception as exc:
            if moves != self._moves:
                return  # it went to disk meanwhile and will be published from there
            self.retries += 1
            if self._spill is not None:
                log.warning("publish of %s failed (%s); spilling to disk", record.id, exc)
                try:
                    self._move_queue_to_disk()
                    return
                except OSError:
                    log.exception("could not spill to %s; retrying from memory", self._spill.directory)
            await self._back_off(record, exc)
            return
        self._delay = 0.0
        if moves == self._moves:
            self._queue.popleft()
            self._published(done)

    async def _replay(self, path: Path) -> None:
        """Publish a spill file's records in order, each until acknowledged, then delete it."""
        assert self._spill is not None
        for entry in self._spill.read(path):
            if entry is None:
                self._spill.backlog -= 1
                self.dropped += 1
                continue
            subject, record = entry
            while True:
                try:
                    await self._bus.publish(subject, record)
                    break
                except Exception as exc:
                    self.retries += 1
                    await self._back_off(record, exc)
            self._delay = 0.0
            self._spill.backlog -= 1
            self._published()
        self._spill.remove(path)

    async def _back_off(self, record: Record, exc: Exception) -> None:
        self._delay = min(max(self._delay * 2, 0.05), 2.0)
        log.warning("publish of %s failed (%s); retrying in %.2fs", record.id, exc, self._delay)
        await asyncio.sleep(self._delay)

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything recorded so far is published, spill files included."""
        await asyncio.wait_for(self._drained.wait(), timeout_s)


def _settle(done: asyncio.Future[None] | None, error: Exception | None = None) -> None:
    if done is None or done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
