"""Running one child process with a wall-clock limit, a bounded output tail and a kill switch.

`BoundedRun` starts a command in its own process group, keeps only the last `output_bytes` of
its stdout and stderr (interleaved, as a terminal would show them), and kills the whole group
when the deadline passes or when another thread calls `kill()` (a sandbox being closed). It
knows nothing about sandboxes: the bubblewrap backend hands it a `bwrap …` argv, whose own
PID namespace then takes every descendant down with it.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

TIMEOUT_RETURNCODE = 124
"""What `timeout(1)` returns, and what mini-swe-agent-style callers expect for a timed-out command."""

_DRAIN_S = 2.0
"""After a kill, how long to keep reading for the last output before giving up on the pipe."""


@dataclass
class Outcome:
    returncode: int
    """The exit status; a signal N is reported as 128 + N like a shell does; 124 on timeout."""
    output: bytes
    timed_out: bool
    killed: bool
    """Stopped by `kill()` (not by its deadline)."""


class BoundedRun:
    """One started process. Call `wait()` once (from the thread that started it); `kill()` may
    be called from any thread at any time, also before or after `wait()`."""

    def __init__(self, argv: list[str], output_bytes: int, pass_fds: tuple[int, ...] = ()):
        self.output_bytes = output_bytes
        self._lock = threading.Lock()
        self._killed = False
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     pass_fds=pass_fds)

    def kill(self) -> None:
        """SIGKILL the process group (a no-op once the process has been reaped)."""
        with self._lock:
            self._killed = True
            self._kill_group()

    def _kill_group(self) -> None:
        # Only while the leader is unreaped, so that its pid (= the group id) is still ours.
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> Outcome:
        """Read output until the pipe closes and the process exits, or until `timeout` seconds
        have passed (then kill the group, keep what it printed, and report a timeout)."""
        deadline = time.monotonic() + timeout
        tail = bytearray()
        timed_out = False
        stdout = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out:  # killed, yet something still holds the pipe open
                        break
                    timed_out = True
                    self._kill_on_deadline()
                    deadline = time.monotonic() + _DRAIN_S
                    continue
                if not selector.select(remaining):
                    continue
                chunk = _read(fd)
                if chunk is None:
                    continue
                if not chunk:
                    break
                tail += chunk
                if len(tail) > 2 * self.output_bytes:
                    del tail[:-self.output_bytes]
        stdout.close()
        try:
            rc = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # the pipe closed but the process lives on
            timed_out = True
            self._kill_on_deadline()
            rc = self.proc.wait()
        with self._lock:
            killed = self._killed
        if timed_out and not killed:
            rc = TIMEOUT_RETURNCODE
        elif rc < 0:
            rc = 128 - rc
        output = bytes(tail[-self.output_bytes:]) if self.output_bytes > 0 else b""
        return Outcome(rc, output, timed_out and not killed, killed)

    def _kill_on_deadline(self) -> None:
        with self._lock:
            self._kill_group()


def _read(fd: int) -> bytes | None:
    """A chunk, b"" at end of file, None when nothing is there after all."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def wait_pid_gone(pid: int, timeout: float) -> bool:
    """Wait until process `pid` has exited (is a zombie or gone); False if it is still running
    after `timeout` s. For the init of a PID namespace that means every process in it is gone:
    the kernel kills and reaps them before their init finishes exiting."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)
