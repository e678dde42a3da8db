"""Which files of a repository belong to its tests (or to how they run) rather than its code,
and a unified diff without its changes to them.

The mutation engine never injects bugs into such files, and grading drops a candidate diff's
changes to them, so a fix cannot make a failing test pass by editing the test, pytest's
configuration (conftest.py, pytest.ini, ...) or the interpreter's startup (sitecustomize.py).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

TEST_DIRS = {"test", "tests", "testing"}
RUN_FILES = {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
             "pyproject.toml", "sitecustomize.py", "usercustomize.py"}


def is_test_path(path: str) -> bool:
    """True for files under a test folder, `test_*.py`, `*_test.py`, and the files in `RUN_FILES`."""
    p = PurePosixPath(path)
    name = p.name
    return (any(part in TEST_DIRS for part in p.parts[:-1]) or name in RUN_FILES
            or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))))


_HEADER = re.compile(r"^diff --git (?:\"?a/(.+?)\"?) (?:\"?b/(.+?)\"?)$")


def _paths(section: list[str]) -> set[str]:
    paths = set()
    for line in section:
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip().strip('"')
            if path != "/dev/null":
                paths.add(path[2:] if path.startswith(("a/", "b/")) else path)
        elif (m := _HEADER.match(line)) is not None:
            paths |= {m.group(1), m.group(2)}
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            paths.add(line.split(" ", 2)[2])
    return paths


def split_diff(diff: str) -> list[list[str]]:
    """A unified diff's per-file sections (lines kept with their ends); text before the first is dropped."""
    sections: list[list[str]] = []
    lines = diff.splitlines(keepends=True)
    git_style = any(line.startswith("diff --git ") for line in lines)
    for i, line in enumerate(lines):
        starts = (line.startswith("diff --git ") if git_style
                  else line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "))
        if starts:
            sections.append([])
        if sections:
            sections[-1].append(line)
    return sections


def without_test_changes(diff: str) -> tuple[str, list[str]]:
    """`diff` less its sections touching test files; and the test files it touched."""
    kept, dropped = [], set()
    for section in split_diff(diff):
        tests = {p for p in _paths(section) if is_test_path(p)}
        if tests:
            dropped |= tests
        else:
            kept.append("".join(section))
    return "".join(kept), sorted(dropped)
