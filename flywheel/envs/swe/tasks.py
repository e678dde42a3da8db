"""SWE task records (SWE-bench's JSONL format), loading them, and materializing a task's repository.

A task set is a folder: `tasks.jsonl`, one record a line, and `repos/`, where the record's
`repo` (with "/" written as "__") is either a git repository (bare or not) holding
`base_commit`, or a bundle file `<repo>.bundle` (cloned once into the cache). Records use
SWE-bench's field names; `FAIL_TO_PASS` and `PASS_TO_PASS` may be JSON lists or, as in
SWE-bench's published files, strings holding a JSON list. Fields SWE-bench lacks say how the
tests run, with defaults for SWE-bench files whose repositories a user provides:

    test_cmd    shell command run from the repository root   (default: python -m pytest -q -p no:cacheprovider)
    pythonpath  folder put on PYTHONPATH, relative to root     (default: ".")
    timeout_s   limit for one run of the test command         (default: 600)
    difficulty  easy | medium | hard (see flywheel/envs/swe/statement.py); version: the project's version

Other fields are kept in `SweTask.extra`. The gold fix is `patch`; `base_commit` is the buggy
tree; `test_patch` (SWE-bench's tests that come with the fix; empty for synthesized tasks) is
applied only when grading. `materialize` exports it into a fresh one-commit repository (history shows nothing).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from flywheel.envs.swe import gitstore
from flywheel.envs.swe.projects import PYTEST

DEFAULT_TEST_CMD = PYTEST
DEFAULT_TIMEOUT_S = 600.0
TINY_TASKS = Path(__file__).resolve().parent / "data" / "tiny" / "tasks.jsonl"


@dataclass
class SweTask:
    instance_id: str
    repo: str
    base_commit: str
    patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    problem_statement: str
    test_patch: str = ""
    """SWE-bench's: applied over the candidate fix before grading (new or changed tests); "" here."""
    version: str = ""
    difficulty: str = ""
    test_cmd: str = DEFAULT_TEST_CMD
    pythonpath: str = "."
    timeout_s: float = DEFAULT_TIMEOUT_S
    extra: dict[str, Any] = field(default_factory=dict)
    """Other fields of the record (e.g. `mutation`, `file`, `seed`, `sdist_sha256`)."""
    root: Path | None = field(default=None, compare=False)
    """The task set's folder (where `repos/` is); set by `load_tasks`."""

    @classmethod
    def from_record(cls, record: dict[str, Any], root: Path | None = None) -> SweTask:
        names = {f.name for f in fields(cls)} - {"extra", "root"}
        values = {k: v for k, v in record.items() if k in names}
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            if isinstance(values.get(key), str):
                values[key] = json.loads(values[key])
        values.setdefault("PASS_TO_PASS", [])
        for key in ("test_cmd", "pythonpath"):
            if not values.get(key):
                values.pop(key, None)
        if values.get("timeout_s") is not None:
            values["timeout_s"] = float(values["timeout_s"])
        else:
            values.pop("timeout_s", None)
        return cls(**values, extra={k: v for k, v in record.items() if k not in names}, root=root)

    def to_record(self) -> dict[str, Any]:
        record = {k: v for k, v in asdict(self).items() if k not in ("extra", "root")}
        return {**record, **self.extra}

    def repo_dir(self) -> Path:
        """The git repository holding `base_commit` (a bundle is cloned into the cache first)."""
        if self.root is None:
            raise ValueError(f"{self.instance_id}: task has no task-set folder (load it with load_tasks)")
        name = self.repo.replace("/", "__")
        plain, bundled = self.root / "repos" / name, self.root / "repos" / f"{name}.bundle"
        if plain.is_dir():
            return plain
        if bundled.is_file():
            return gitstore.cached_clone(bundled)
        raise FileNotFoundError(f"{self.instance_id}: neither {plain}/ nor {bundled} exists")


def load_tasks(path: Path | str) -> list[SweTask]:
    """The tasks of a JSONL file; its folder is the task set's root (where `repos/` is)."""
    path = Path(path)
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(SweTask.from_record(json.loads(line), root=path.resolve().parent))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a task record: {e}") from e
    return tasks


def save_tasks(tasks: list[SweTask], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_record()) + "\n" for t in tasks))


def find_task(tasks: list[SweTask], instance_id: str) -> SweTask:
    for task in tasks:
        if task.instance_id == instance_id:
            return task
    raise KeyError(f"no task {instance_id!r}")


def materialize(task: SweTask, dest: Path) -> Path:
    """The task's buggy repository at `dest` (must not exist): its tree, one commit, no history."""
    gitstore.export(task.repo_dir(), task.base_commit, dest)
    return dest
