"""Where built models live, and how directories are written so nobody sees half of one.

Everything Flywheel builds or converts (the tiny test model, the SmolLM2 import) is cached under
`cache_root()`. Directories are always written into a temporary sibling first and then renamed
into place with one `os.rename`, which is atomic on POSIX file systems: a reader sees either no
directory or a complete one. Processes that want the same thing built take turns (a lock file
beside it): one builds, the others wait and read its result instead of building it again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"
log = logging.getLogger(__name__)


def cache_root() -> Path:
    """`$FLYWHEEL_CACHE` if set, else `~/.cache/flywheel`."""
    env = os.environ.get("FLYWHEEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flywheel"


def fsync_tree(path: Path) -> None:
    """Flush every file under `path`, then the directories themselves, to disk."""
    dirs = [path]
    for entry in sorted(path.rglob("*")):
        if entry.is_dir():
            dirs.append(entry)
        elif entry.is_file():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    for d in dirs:
        fsync_directory(d)


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of `dest`; on a clean exit, rename it to `dest`.

    The temporary directory is `dest.parent/.tmp-<dest.name>-<random>`. Its files are fsynced before
    the rename. If the block raises, or `dest` already exists when the block ends, the temporary
    directory is removed; the latter raises `FileExistsError`.
    """
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the result from other users (e.g. an engine's)
    try:
        yield tmp
        fsync_tree(tmp)
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if dest.exists():
                raise FileExistsError(f"{dest} already exists") from e
            raise
        fsync_directory(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_build(name: str, build: Callable[[Path], None], usable: Callable[[Path], bool] | None = None) -> Path:
    """Return `cache_root()/name`, calling `build(tmp_dir)` to create it the first time.

    `build` fills an empty temporary directory; it is renamed into place when `build` returns.
    While one process builds, others asking for the same name wait for its result (a model's
    conversion or a reader's training, once per machine, not once per process that starts then).
    `usable(path)`, if given, says whether a cached result can still be read: one that cannot is
    removed and built again, by one process while the others wait, as the first time. A build that
    fails is tried again by the next process that asks (each waiter in turn, if it keeps failing).
    """
    dest = cache_root() / name
    if dest.is_dir() and _usable(dest, usable):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if dest.is_dir() and not _usable(dest, usable):
            log.warning("the cached %s cannot be read: building it again", dest)
            shutil.rmtree(dest)
        if not dest.is_dir():
            try:
                with atomic_directory(dest) as tmp:
                    build(tmp)
            except FileExistsError:  # built by a process that did not take the lock
                if not dest.is_dir():
                    raise
        # Built: whoever still waits on this file, or opens a new one, finds `dest` and returns.
        lock_path.unlink(missing_ok=True)
    return dest


def _usable(dest: Path, usable: Callable[[Path], bool] | None) -> bool:
    """`usable(dest)`, where a result that cannot be opened is not usable: checked without the lock,
    it may be a damaged result that another process is removing to build it again."""
    if usable is None:
        return True
    try:
        return usable(dest)
    except OSError:
        return False
