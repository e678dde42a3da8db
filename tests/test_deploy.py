"""`flywheel up` and `Deployment`'s life: it starts its own Ray or joins one, shows progress, and
stops cleanly on Ctrl-C (also one that lands inside a stats call); a loop that cannot start fails
the start with its reason. (That the deployed loop learns: test_deploy_loop.py; that a gate
rejecting every version does not stall it: test_deploy_gate.py.)"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from flywheel.cli import command
from flywheel.config import load_config
from flywheel.deploy.deployment import Deployment
from flywheel.train.run_lock import RunLock

from waiting import until_sync


def running(process: psutil.Process) -> bool:
    """Whether `process` still runs: a zombie has exited (orphaned, it waits for this machine's init
    to reap it, which was seen to take more than 30 s under load)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ray_log_tails(ray_temp_dir: Path, lines: int = 10) -> str:
    """The last `lines` of the raylet's warnings and errors and of each worker's stderr (where
    the loops log) of the Ray under `ray_temp_dir`: what a start that did not finish was doing."""
    logs = Path(ray_temp_dir) / "session_latest" / "logs"
    tails = []
    for path in [logs / "raylet.out", *sorted(logs.glob("worker-*.err"))]:
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        if path.name == "raylet.out":
            text = [line for line in text if re.match(r"\[[^\]]* [WEF] ", line)]
        if text:
            tails.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
    return "\n".join(tails)


UP_S = 300.0
"""How long `flywheel up` may take to come up and train a step: as long as the deployment gives
its loops to start (`CALL_TIMEOUT_S`), past which it fails the start itself, naming them. Near
the end of a fresh clone's suite, three Ray clusters and their loops on two cores, Ray's own calls
took 11-20 s and a start took more than 180 s (40-80 s in most)."""


def start_up(run_dir, *overrides: str, ray_temp_dir: Path, env=None,
             timeout_s: float = UP_S) -> tuple[subprocess.Popen, list[str]]:
    """`flywheel up` on the local config and what it printed, returned once it is up and has
    trained a step (within `timeout_s`, else it is stopped with everything it started, and the
    test fails with what it printed and what its Ray, under `ray_temp_dir`, logged). Without the
    promotion gate (its evaluation server and loop only lengthen the start; test_deploy_loop.py
    runs make run's configuration whole)."""
    proc = subprocess.Popen(
        [*command("up"), "--config", "configs/local.yaml", f"run_dir={run_dir}",
         "serve.port=0", "promotion.mode=off", *overrides, "--refresh-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []

    def trained_a_step() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("version=") and int(line.split()[0].removeprefix("version=")) >= 1:
                return

    reader = threading.Thread(target=trained_a_step, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive() or not any("Flywheel is up" in line for line in lines):
        kill_with_children(proc)
        raise AssertionError(f"flywheel up did not come up and train a step within {timeout_s:g} s:\n" + "".join(lines)
                             + f"\nits Ray logged:\n{ray_log_tails(ray_temp_dir)}")
    return proc, lines


def kill_with_children(proc: subprocess.Popen) -> None:
    """Kill `flywheel up` and everything it started (its NATS, its Ray's processes)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def stop_up(proc: subprocess.Popen, ray_temp_dir: Path, timeout_s: float = 120.0) -> str:
    """Ctrl-C to `flywheel up` and what it printed until it exited (within `timeout_s`, else the
    test fails with its threads' stacks, what it printed and what its Ray logged)."""
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack, to the output
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=5)
        kill_with_children(proc)
        rest, _ = proc.communicate()
        raise AssertionError(f"flywheel up did not stop within {timeout_s:g} s of Ctrl-C:\n{rest}"
                             f"\nits Ray logged:\n{ray_log_tails(ray_temp_dir)}") from None
    assert proc.returncode == 0 and "stopped." in rest, rest
    return rest


@pytest.mark.timeout(UP_S + 300)  # and its stop, which may take 120 s
def test_up_starts_its_own_ray_shows_progress_and_ctrl_c_leaves_no_process(tmp_path):
    # The address a `ray start` wrote down for later `ray.init()` calls on this machine, its
    # cluster gone: with no `deploy.ray_address`, `flywheel up` starts a Ray of its own all the same.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""}
    proc, lines = start_up(tmp_path, ray_temp_dir=ray_tmp / "ray", env=env)
    try:
        up = [line.split(" is up (")[0] for line in lines if " is up (" in line]  # said as each loop came up
        assert sorted(up) == ["collect", "judge", "rollout", "serve", "train"], lines
        family = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in family if p.is_running()}
        assert "nats-server" in names and any("raylet" in n for n in names), names
        rest = stop_up(proc, ray_tmp / "ray")
        assert [line.split(" stopped (")[0] for line in rest.splitlines() if " stopped (" in line] == [
            "rollout", "serve", "collect", "judge", "train"], rest  # said as each loop stopped
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not [p for p in alive if running(p)], [p.name() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.timeout(UP_S + 300)  # and the cluster's start and stop
def test_up_joins_an_existing_cluster_and_leaves_it_running(tmp_path):
    ray_cli = str(Path(sys.executable).parent / "ray")
    port = 6390
    env = {**os.environ, "RAY_ADDRESS": ""}
    temp_dir = tempfile.mkdtemp(prefix="rayx", dir="/tmp")  # marks this cluster's processes
    subprocess.run(
        [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}"],
        check=True, capture_output=True, env=env, timeout=120,
    )
    try:
        proc, _ = start_up(tmp_path, f"deploy.ray_address=127.0.0.1:{port}", ray_temp_dir=temp_dir, env=env)
        stop_up(proc, Path(temp_dir))
        status = subprocess.run([ray_cli, "status", f"--address=127.0.0.1:{port}"], capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr  # the cluster outlives the deployment
    finally:  # stop this cluster only (`ray stop` would take the test session's Ray down too)
        ours = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
        gcs = [p for p in ours if "gcs_server" in " ".join(p.info["cmdline"])]
        # The GCS last: terminated together, the raylet and the GCS wait on each other (20 s, then SIGKILL).
        for processes in ([p for p in ours if p not in gcs], gcs):
            for process in processes:
                process.terminate()
            _, alive = psutil.wait_procs(processes, timeout=20)
            for process in alive:
                process.kill()


def test_a_signal_that_lands_inside_a_stats_call_still_stops_the_deployment():
    """Ctrl-C raised as KeyboardInterrupt inside `ray.get` (the stats call of every refresh) came
    back from Ray as that call's error: the progress went on and nothing stopped (test_deploy's
    Ctrl-C test timed out under load). A signal now only asks to stop."""
    import os

    from rich.console import Console

    from flywheel.deploy.foreground import run_in_foreground

    class SwallowingDeployment:  # what Ray did with the interrupt, around a real signal
        def __init__(self):
            self.calls, self.stopped = 0, False

        def start(self, progress):
            return self

        def stats(self):
            self.calls += 1
            if self.calls == 2:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)  # the interrupt arrives while "Ray" waits
                except KeyboardInterrupt:
                    return {"train": {"error": "interrupted"}}
            return {"train": {"version": self.calls}}

        def stop(self, progress):
            self.stopped = True

    deployment = SwallowingDeployment()
    stats = run_in_foreground(deployment, Console(file=open(os.devnull, "w")), refresh_s=0.01,
                              done=lambda stats: deployment.calls > 50)
    assert deployment.stopped and deployment.calls <= 3, deployment.calls
    assert stats["train"] in ({"error": "interrupted"}, {"version": 2}, {"version": 3})


def test_a_loop_that_cannot_start_fails_the_start_with_its_reason_and_stops_the_rest(ray_session, tmp_path):
    """The loops start side by side; the trainer refuses (another trainer holds the run
    directory): starting raises the trainer's own reason, and every loop started is stopped."""
    config = load_config("configs/local.yaml", [f"run_dir={tmp_path}", "serve.port=0"])
    lock = RunLock(tmp_path)
    lock.acquire()
    deployment = Deployment(config)
    try:
        with pytest.raises(Exception, match="one trainer per run directory"):
            deployment.start()
    finally:
        lock.release()
    assert deployment.actors == {}
    until_sync(lambda: not [a for a in ray.util.list_named_actors() if a.startswith("flywheel-")])
