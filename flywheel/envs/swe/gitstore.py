"""Git plumbing for task repositories: storing buggy trees, bundling, and exporting a task.

A task set keeps one bare repository per project (`DIR/repos/<repo>/`). Each task's buggy tree
is a parentless commit under `refs/tasks/<instance_id>` (its sha is the task's `base_commit`);
trees of one project share their unchanged blobs, so a few hundred tasks cost little more than
one copy of the project. The pristine tree is never a commit (the gold patch is the reverse of
the bug), so no history leads from a task to its fix. A repository can also be shipped as one
`git bundle` file (`DIR/repos/<repo>.bundle`), cloned once into the cache on first use.

Exporting a task writes the commit's tree into a fresh folder with a brand-new repository of
one commit, so the agent's `git diff` shows exactly its own changes and `git log` shows nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from flywheel.models.cache import cached_build

IDENTITY = {"GIT_AUTHOR_NAME": "flywheel", "GIT_AUTHOR_EMAIL": "flywheel@localhost",
            "GIT_COMMITTER_NAME": "flywheel", "GIT_COMMITTER_EMAIL": "flywheel@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
EXCLUDE = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n"


class GitError(RuntimeError):
    pass


def git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, input: bytes | None = None) -> str:
    """Run git (as any user: `safe.directory=*`), returning stdout; raises with stderr on failure."""
    proc = subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, input=input,
                          env={**os.environ, **IDENTITY, **(env or {})}, capture_output=True)
    if proc.returncode != 0:
        raise GitError(f"git {' '.join(args[:3])}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode()


def init_store(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "--bare", str(path))
    return path


def write_tree(store: Path, worktree: Path, index: Path) -> str:
    """Add every file of `worktree` (ignore rules too are ignored) to `index`; the tree's sha."""
    env = {"GIT_DIR": str(store.resolve()), "GIT_WORK_TREE": str(worktree.resolve()),
           "GIT_INDEX_FILE": str(index.resolve())}
    git("add", "-A", "-f", ".", cwd=worktree, env=env)
    return git("write-tree", env=env).strip()


def tree_with(store: Path, tree: str, path: str, content: bytes) -> str:
    """`tree` with the file at `path` (which it has) replaced by `content`; the new tree's sha."""
    store = str(store)
    mode = git("--git-dir", store, "ls-tree", tree, "--", path).split()[0]
    blob = git("--git-dir", store, "hash-object", "-w", "--stdin", input=content).strip()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("--git-dir", store, "read-tree", tree, env=env)
        git("--git-dir", store, "update-index", "--cacheinfo", f"{mode},{blob},{path}", env=env)
        return git("--git-dir", store, "write-tree", env=env).strip()


def diff(store: Path, old: str, new: str) -> str:
    """The patch that turns tree `old` into tree `new`."""
    return git("--git-dir", str(store), "diff", "--no-color", "--no-renames", old, new)


def commit_tree(store: Path, tree: str, ref: str, message: str = "base") -> str:
    """A parentless commit of `tree`, named by `ref`; its sha."""
    sha = git("--git-dir", str(store), "commit-tree", tree, "-m", message).strip()
    git("--git-dir", str(store), "update-ref", ref, sha)
    return sha


def pack(store: Path) -> None:
    """Pack `store`'s loose objects and refs (a few hundred trees of one project share most blobs)."""
    git("--git-dir", str(store), "repack", "-adq")
    git("--git-dir", str(store), "pack-refs", "--all")


def bundle(store: Path, dest: Path) -> None:
    """Every ref of `store` in one bundle file."""
    git("--git-dir", str(store), "bundle", "create", "-q", str(dest), "--all")


def cached_clone(bundle_file: Path) -> Path:
    """A bare clone of `bundle_file` with all its refs, made once and kept in the cache under the
    bundle's content hash (written beside its place and renamed into it, so a reader never sees
    half of one)."""
    stat = bundle_file.stat()
    digest = _bundle_digest(bundle_file.resolve(), stat.st_size, stat.st_mtime_ns)

    def clone(tmp: Path) -> None:
        git("init", "-q", "--bare", str(tmp))
        git("--git-dir", str(tmp), "fetch", "-q", str(bundle_file.resolve()), "refs/*:refs/*")

    return cached_build(f"swe/bundles/{bundle_file.stem}-{digest}.git", clone)


@functools.cache
def _bundle_digest(path: Path, size: int, mtime_ns: int) -> str:
    """The bundle's content hash, read once per file version (a rewritten bundle is hashed anew)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def export(repo: Path, commit: str, dest: Path) -> None:
    """Write `commit`'s tree into `dest` (created; must not exist) as a one-commit repository."""
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(dest.resolve())}
        git("read-tree", commit, cwd=repo, env=env)
        git("checkout-index", "-a", "-f", cwd=repo, env=env)
    git("init", "-q", cwd=dest)
    (dest / ".git" / "info" / "exclude").write_text(EXCLUDE)
    git("add", "-A", "-f", ".", cwd=dest)
    git("commit", "-q", "--no-verify", "-m", "Initial commit", cwd=dest)


def apply(repo: Path, diff: str) -> str:
    """Apply `diff` to `repo`'s working tree; an empty string, or why it does not apply."""
    if not diff.strip():
        return ""
    if not diff.endswith("\n"):
        diff += "\n"
    try:
        git("apply", "--whitespace=nowarn", "-", cwd=repo, input=diff.encode())
    except GitError as e:
        return str(e)[-2000:]
    return ""


def working_diff(repo: Path) -> str:
    """`repo`'s working tree against HEAD, new files included, staged through a private index so
    the repository's own index is left as the agent left it."""
    env = {"GIT_INDEX_FILE": str(repo / ".git" / "flywheel-diff-index")}
    git("read-tree", "HEAD", cwd=repo, env=env)
    git("add", "-A", cwd=repo, env=env)
    return git("diff", "--cached", "--binary", "HEAD", cwd=repo, env=env)
