"""Pinned source distributions from the package index: download once, verify, unpack.

`fetch` runs `pip download --no-deps --no-binary NAME NAME==VERSION` (only this package from
source, so pip does not build its build backend from source too) into the cache
(`<cache_root>/swe/sdists/`), and checks the file's sha256 against the pin in `projects.py`.
`unpack` extracts the archive's single top-level folder into a destination folder.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from flywheel.envs.swe.projects import Project
from flywheel.models.cache import cache_root


def sdist_dir() -> Path:
    return cache_root() / "swe" / "sdists"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(project: Project) -> Path:
    """The project's sdist, from the cache or downloaded into it; raises if its hash differs."""
    dest = sdist_dir() / f"{project.name}-{project.version}.tar.gz"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
                            project.name, project.requirement, "--dest", tmp], check=True)
            found = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".zip"))]
            if len(found) != 1:
                raise RuntimeError(f"pip download {project.requirement} gave {found}, not one sdist")
            shutil.move(found[0], dest)
    digest = _sha256(dest)
    if digest != project.sdist_sha256:
        raise RuntimeError(f"{dest}: sha256 {digest}, pinned {project.sdist_sha256}")
    return dest


def unpack(archive: Path, dest: Path) -> Path:
    """Extract `archive` (one top-level folder) so that folder's contents are `dest`'s."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        shutil.move(top, dest)
    return dest
