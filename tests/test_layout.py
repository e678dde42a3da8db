"""The house rules, enforced.

- The loops (serve, collect, judge, train, promote) and the rollout driver never import one
  another. What two of them share lives in `flywheel/bus/` (the wire), `flywheel/models/`
  (weights and tokenizers), or a small package named for what it holds; `flywheel/deploy/` hosts
  them by name. Every import counts, also one inside a function.
- The project installs one top-level package, `flywheel`.
- No file of the package or the benchmarks runs past 400 lines.
- No test module imports another: what tests share is in `tests/factories.py`,
  `tests/bus_reading.py`, `tests/tenant_traffic.py`, `tests/peft_adapters.py` (random PEFT adapters),
  `tests/adapter_training.py` (the trainer's adapter tests'), `tests/engine_adapters.py` (the
  engine's), `tests/file_groups.py` (how `make test` spreads the files) or `conftest.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flywheel"
PROCESSES = ("serve", "collect", "judge", "train", "rollout", "promote")
MAX_LINES = 400


def imported_modules(path: Path, package: str) -> set[tuple[str, int]]:
    """(module, line) of every import in a file of the dotted `package`: relative ones resolved
    against it, and each name a `from` import takes (`from flywheel import judge` imports
    `flywheel.judge`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            found.add((base, node.lineno))
            found.update((f"{base}.{alias.name}", node.lineno) for alias in node.names)
    return found


def package_of(path: Path) -> str:
    """flywheel/serve/api/chat.py -> flywheel.serve.api"""
    return ".".join(path.relative_to(ROOT).parent.parts)


def flywheel_package(module: str) -> str | None:
    """`flywheel.judge.build` -> `judge`; None for a module outside flywheel."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flywheel" and len(parts) > 1 else None


def crossings(package: str) -> list[str]:
    others = set(PROCESSES) - {package}
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module, line in sorted(imported_modules(path, package_of(path)))
        if flywheel_package(module) in others
    ]


@pytest.mark.parametrize("package", PROCESSES)
def test_a_loop_imports_no_other_loop(package):
    assert (PACKAGE / package).is_dir()
    assert crossings(package) == []


def test_the_rule_sees_imports_inside_functions(tmp_path):
    """The check itself: a lazy import of another loop is found."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from flywheel.judge.build import build_judge\n    import flywheel.train.loop\n")
    assert {flywheel_package(module) for module, _ in imported_modules(source, "flywheel.serve")} == {"judge", "train"}


def test_the_rule_sees_relative_imports_and_imported_packages(tmp_path):
    """`from ..judge import build` in flywheel/serve/api/, and `from flywheel import train`."""
    source = tmp_path / "sly.py"
    source.write_text("from ...judge import build\nfrom .. import gateway\nfrom flywheel import train\n")
    found = {flywheel_package(module) for module, _ in imported_modules(source, "flywheel.serve.api")}
    assert found == {"judge", "serve", "train", None}
    assert package_of(PACKAGE / "serve" / "api" / "chat.py") == "flywheel.serve.api"


def test_one_top_level_package_is_installed():
    """What `pip install` puts at the top of site-packages: `flywheel`, and nothing beside it."""
    import tomllib

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=found["include"])
    assert packages and {name.split(".")[0] for name in packages} == {"flywheel"}
    assert "flywheel.serve.engine" in packages


def test_no_file_of_the_package_or_the_benchmarks_is_over_400_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in ("flywheel", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert long == []


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    shared = {"factories", "bus_reading", "waiting", "conftest", "adapter_training", "peft_adapters",
              "engine_adapters", "tenant_traffic", "file_groups", "served_people"}
    own = {path.stem for path in tests.glob("*.py")} - shared
    imports = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(tests.glob("*.py"))
        for module, line in sorted(imported_modules(path, "tests"))
        if module.split(".")[0] in own or module.startswith("tests.") or module.split(".")[0] == "bench"
    ]
    assert imports == []
