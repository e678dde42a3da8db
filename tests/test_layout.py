"""The house rule, enforced: the loops (serve, collect, judge, train, promote) and the rollout driver never
import one another. What two of them share lives in `bus/` (the wire) or `models/` (weights and
tokenizers); `deploy/` hosts them by name. Every import counts, also one inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = ("serve", "collect", "judge", "train", "rollout", "promote")


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def crossings(package: str) -> list[str]:
    others = set(PROCESSES) - {package}
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line in sorted(imported_packages(path))
        if name in others
    ]


@pytest.mark.parametrize("package", PROCESSES)
def test_a_loop_imports_no_other_loop(package):
    assert (ROOT / package).is_dir()
    assert crossings(package) == []


def test_the_rule_sees_imports_inside_functions(tmp_path):
    """The check itself: a lazy import of another loop is found."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from judge.registry import build_judge\n    import train.loop\n")
    assert imported_packages(source) == {("judge", 2), ("train", 3)}
