"""Ports for the servers a process starts (flywheel/ports.py): drawn outside the kernel's range for
outgoing connections' own ports and Ray's workers' ports, free when drawn, and still found on a
host whose range covers every port."""

import socket

from flywheel import ports


def test_a_port_is_drawn_free_and_outside_the_range_for_outgoing_connections():
    low, high = ports.ephemeral_range()
    drawn = {ports.free_port() for _ in range(20)}
    if low - ports.LOWEST >= 1000:
        assert all(ports.LOWEST <= port < low for port in drawn)
    assert len(drawn) > 1  # drawn at random, not the same one each time
    for port in drawn:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_host_whose_range_covers_every_port_still_gets_one(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_is_never_one_that_rays_workers_bind():
    """Ray's workers bind ports in `ray start`'s worker range (10002-19999): a Ray head given a port
    drawn there refused to start (the Ray node drill then waited forever for its GCS), and a
    gateway's or vLLM's port there could be taken by a Ray worker starting after the draw."""
    from ray.scripts.scripts import start

    defaults = {param.name: param.default for param in start.params}
    workers = range(defaults["min_worker_port"], defaults["max_worker_port"] + 1)
    drawn = {ports.free_port() for _ in range(200)}
    assert not drawn & set(workers), sorted(drawn & set(workers))[:5]
