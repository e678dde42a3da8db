"""Choosing a TCP port for a server this process starts and tells others about (a cluster
member's fixed client, route and monitoring ports; a vLLM server's).

The port is drawn above Ray's worker ports and outside the range the kernel hands out as the
local port of outgoing connections (`/proc/sys/net/ipv4/ip_local_port_range`). A port the
kernel chose (binding to port 0) comes from that range, and between choosing it and the server
binding it any connection this machine opens may be given it: a three-server bus in the test
suite once failed to start so, a member's port taken while two test workers opened hundreds of
connections. Outside the range only another explicit bind can take it. Still checked free, and
still a race with those: callers that can, retry.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20_000
"""Below it sit the well-known and registered services' usual ports, and the range Ray's workers
bind (10002-19999 by default): a Ray head refuses a port there, and a worker starting after the
draw could take it."""
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default elsewhere)."""
    try:
        low, high = map(int, EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port nothing listens on now, outside the ephemeral range when there is room below it."""
    low, high = ephemeral_range()
    candidates = range(LOWEST, low) if low - LOWEST >= 1000 else range(high + 1, 65536)
    draw = random.SystemRandom()
    for _ in range(tries if candidates else 0):  # none when the range covers every port (a tuned host)
        port = draw.choice(candidates)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # everything drawn was taken: the kernel's choice, as a last resort
        sock.bind((host, 0))
        return sock.getsockname()[1]
