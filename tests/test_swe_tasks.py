"""SWE tasks (envs/swe): the shipped tiny set loads and materializes without revealing its fix,
grading rewards exactly the real fixes (never test edits), `validate` and `exec` behave as
documented, SWE-bench files with user-provided repositories load, and the mutation engine is
seeded and touches only non-test code.

Everything runs on the checked-in tiny set (bundled repositories, no network) in bubblewrap
sandboxes; bwrap missing is a failure here, as in test_sandbox.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.cli import command
from flywheel.envs.swe import TINY_TASKS, SweTask, grade, load_tasks, materialize
from flywheel.envs.swe.mutate import find_sites, mutate, sample_sites
from flywheel.envs.swe.testenv import default_backend
from flywheel.envs.swe.testpaths import without_test_changes
from waiting import until_sync

ROOT = Path(__file__).resolve().parent.parent
SLOT = 800  # slots of their own (uid 10800+): other tests sandbox 0, 1, ... and 700+


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(repo), *args], check=True,
                          capture_output=True, text=True).stdout


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*command("swe"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tasks():
    return load_tasks(TINY_TASKS)


@pytest.fixture(scope="module")
def backend():
    return default_backend()


def _easy(tasks):
    return next(t for t in tasks if t.difficulty == "easy")


def test_the_tiny_set_loads_with_every_field(tasks):
    assert len(tasks) >= 10
    assert {t.repo for t in tasks} >= {"tinydb", "addict", "parse"}
    assert "easy" in {t.difficulty for t in tasks} and {t.difficulty for t in tasks} <= {"easy", "medium", "hard"}
    assert len({t.instance_id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS and not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert t.patch.startswith("diff --git") and len(t.base_commit) == 40
        assert t.test_cmd.startswith("python -m pytest") and t.version and t.timeout_s > 0
        assert t.FAIL_TO_PASS[0] in t.problem_statement
        assert t.patch not in t.problem_statement
    easy = _easy(tasks)
    assert f"`{easy.extra['file']}`" in easy.problem_statement  # easy: the statement names the file
    assert sum(f.stat().st_size for f in TINY_TASKS.parent.rglob("*")) < 2_000_000


def test_a_materialized_task_has_one_commit_and_does_not_reveal_its_fix(tasks, tmp_path):
    task = tasks[0]
    repo = materialize(task, tmp_path / "repo")
    assert _git(repo, "rev-list", "--all").split() == [_git(repo, "rev-parse", "HEAD").strip()]
    assert _git(repo, "status", "--porcelain") == ""
    fixed_blob = next(line for line in task.patch.splitlines() if line.startswith("index ")).split("..")[1].split()[0]
    objects = _git(repo, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    assert not any(o.startswith(fixed_blob) for o in objects)  # the fixed file is nowhere in the repository
    subprocess.run(["git", "-C", str(repo), "apply", "--check", "-"], input=task.patch, text=True, check=True)


def test_grading_rewards_the_gold_patch_and_nothing_else(tasks, backend):
    task = _easy(tasks)
    gold = grade(task, task.patch, backend, SLOT)
    assert gold.reward == 1.0 and gold.details["resolved"] and all(gold.details["FAIL_TO_PASS"].values())
    assert gold.details["stats"]["passed"] >= len(task.FAIL_TO_PASS) + len(task.PASS_TO_PASS)
    empty = grade(task, "", backend, SLOT)
    assert empty.reward == 0.0 and empty.details["applied"] and not any(empty.details["FAIL_TO_PASS"].values())
    assert empty.details["PASS_TO_PASS_failed_count"] == 0
    other = next(t for t in tasks if t.repo != task.repo)
    wrong = grade(task, other.patch, backend, SLOT)
    assert wrong.reward == 0.0 and not wrong.details["applied"] and "does not apply" in wrong.details["reason"]
    assert grade(task, "not a diff\n", backend, SLOT).reward == 0.0


def test_a_grading_killed_mid_run_leaves_nothing_past_its_slots_next_grading(tasks, backend, tmp_path, monkeypatch):
    """A run's env workers are killed when it ends, some mid-grading: what such a grading leaves
    goes with the slot's next one, instead of piling up (a copy per killed grading)."""
    work = tmp_path / "work"
    monkeypatch.setenv("FLYWHEEL_SANDBOX_WORK", str(work))
    task, slot = _easy(tasks), SLOT + 2
    script = ("import sys; from flywheel.envs.swe import TINY_TASKS, grade, load_tasks; "
              "task = next(t for t in load_tasks(TINY_TASKS) if t.instance_id == sys.argv[1]); "
              "grade(task, task.patch, None, int(sys.argv[2]))")
    doomed = subprocess.Popen([sys.executable, "-c", script, task.instance_id, str(slot)], cwd=ROOT,
                              start_new_session=True)
    try:
        until_sync(lambda: any(work.glob("*/.git")))  # its copy of the repository is made
    finally:  # the grading and its git commands: an orphaned `git add` could still be writing
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
    assert any(work.iterdir())
    assert grade(task, task.patch, backend, slot).reward == 1.0
    assert list(work.iterdir()) == []


CHEAT = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''


def test_a_diff_that_edits_tests_gets_no_credit_for_it(tasks, backend, tmp_path):
    task = _easy(tasks)
    repo = materialize(task, tmp_path / "repo")
    (repo / "conftest.py").write_text(CHEAT)  # makes every test pass, if it counted
    test_file = task.FAIL_TO_PASS[0].split("::")[0]
    (repo / test_file).write_text((repo / test_file).read_text() + "\n# edited\n")
    _git(repo, "add", "-A")
    cheat = _git(repo, "diff", "--cached")
    kept, excluded = without_test_changes(cheat + task.patch)
    assert excluded == sorted(["conftest.py", test_file]) and kept == task.patch

    hacked = grade(task, cheat, backend, SLOT)
    assert hacked.reward == 0.0 and hacked.details["excluded_files"] == excluded
    # A module named like the report plugin, at the repository root, does not replace it.
    ids = task.FAIL_TO_PASS + task.PASS_TO_PASS
    (repo / "swe_report.py").write_text(
        "import json, os\n\n\ndef pytest_sessionfinish(session, exitstatus):\n"
        f"    report = {{'tests': {{t: {{'outcome': 'passed', 'message': ''}} for t in {ids!r}}}}}\n"
        "    json.dump(report, open(os.environ['SWE_REPORT'], 'w'))\n")
    _git(repo, "add", "-A")
    assert grade(task, _git(repo, "diff", "--cached", "--", "swe_report.py"), backend, SLOT).reward == 0.0
    assert grade(task, cheat + task.patch, backend, SLOT).reward == 1.0
    # Applied for real, the conftest would have made the failing tests pass: excluding it matters.
    run = _cli("exec", "--slot-base", str(SLOT), str(TINY_TASKS), task.instance_id, "--",
               f"cat > conftest.py <<'EOF'\n{CHEAT}EOF\n{task.test_cmd}")
    assert run.returncode == 0, run.stdout[-2000:]


def test_validate_passes_the_tiny_set(tasks):
    run = _cli("validate", "--jobs", "2", "--slot-base", str(SLOT), str(TINY_TASKS))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == len(tasks)
    assert lines[-1].startswith(f"valid {len(tasks)}/{len(tasks)} tasks")


def test_validate_fails_a_corrupted_task(tasks, tmp_path):
    shutil.copytree(TINY_TASKS.parent / "repos", tmp_path / "repos")
    good, bad = (t.to_record() for t in tasks[:2])
    bad["FAIL_TO_PASS"] = bad["FAIL_TO_PASS"] + bad["PASS_TO_PASS"][:1]  # a test that passes without the fix
    (tmp_path / "tasks.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    run = _cli("validate", "--jobs", "2", "--slot-base", str(SLOT), str(tmp_path / "tasks.jsonl"))
    assert run.returncode == 1
    assert f"FAIL  {bad['instance_id']}: 1 FAIL_TO_PASS tests pass at base_commit" in run.stdout
    assert f"ok    {good['instance_id']}" in run.stdout and "valid 1/2 tasks" in run.stdout


def test_exec_runs_a_command_at_the_base_commit_and_returns_its_status(tasks):
    task = tasks[0]
    run = _cli("exec", "--slot-base", str(SLOT), str(TINY_TASKS), task.instance_id, "--",
               "git log --oneline | wc -l; python -c 'import sys; print(sys.prefix)'; exit 3")
    assert run.returncode == 3
    assert run.stdout.split()[:2] == ["1", sys.prefix]
    slow = _cli("exec", "--timeout", "1", "--slot-base", str(SLOT), str(TINY_TASKS), task.instance_id, "--", "sleep 30")
    assert slow.returncode == 124 and "timed out" in slow.stderr


def test_exec_keeps_each_word_of_the_command_as_docker_exec_does(tasks):
    """`exec ... -- bash -c "false && echo ok"` runs bash with that one script (joined with spaces,
    `bash -c false` ran and the rest became positional arguments: exit 1 printing nothing was
    indistinguishable from a real failure, and `-c "pytest -q && echo ok"` exited 0 having run
    nothing). A single word stays a shell line, as before."""
    task = tasks[0]
    run = _cli("exec", "--slot-base", str(SLOT), str(TINY_TASKS), task.instance_id, "--",
               "bash", "-c", "echo one two && exit 5")
    assert (run.returncode, run.stdout) == (5, "one two\n")
    quoted = _cli("exec", "--slot-base", str(SLOT), str(TINY_TASKS), task.instance_id, "--",
                  "printf", "%s|", "a b", "it's")
    assert quoted.stdout == "a b|it's|"


def _diff(path: str, old: str | None, new: str) -> str:
    """A one-line change of `path` (or a new one-line file when `old` is None)."""
    head = f"diff --git a/{path} b/{path}\n"
    if old is None:
        return head + f"new file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+{new}\n"
    return head + f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old}\n+{new}\n"


def test_a_swe_bench_file_with_a_user_provided_repository_loads_and_grades(tmp_path, backend):
    repo = tmp_path / "repos" / "octo__lib"
    repo.mkdir(parents=True)
    (repo / "lib.py").write_text("X = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "one")
    record = {"instance_id": "octo__lib-1", "repo": "octo/lib", "base_commit": _git(repo, "rev-parse", "HEAD").strip(),
              "patch": _diff("lib.py", "X = 1", "X = 2"), "problem_statement": "X must be 2.",
              "test_patch": _diff("test_lib.py", None, "def test_x(): from lib import X; assert X == 2"),
              "FAIL_TO_PASS": '["test_lib.py::test_x"]', "PASS_TO_PASS": "[]", "hints_text": "", "created_at": "2024"}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    (task,) = load_tasks(tmp_path / "tasks.jsonl")
    assert task.FAIL_TO_PASS == ["test_lib.py::test_x"] and task.PASS_TO_PASS == []
    assert task.test_cmd == "python -m pytest -q -p no:cacheprovider" and task.pythonpath == "."
    assert task.extra == {"hints_text": "", "created_at": "2024"}
    assert SweTask.from_record(json.loads(json.dumps(task.to_record())), task.root) == task
    out = materialize(task, tmp_path / "copy")
    assert sorted(p.name for p in out.iterdir()) == [".git", "lib.py"]  # the test_patch is not shown
    assert len(_git(out, "rev-list", "--all").split()) == 1
    assert grade(task, task.patch, backend, SLOT).reward == 1.0
    assert grade(task, "", backend, SLOT).reward == 0.0


SOURCE = '''def f(a, b, items):
    if a < b and not items:
        return True
    n = a + 2 * b
    n += 1
    return (n, a in items)
'''


def _repo(root: Path) -> Path:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(SOURCE)
    (root / "pkg" / "tests" / "test_f.py").write_text("from pkg import f\n\n\ndef test_f():\n    assert f(1, 2, [])\n")
    (root / "pkg" / "conftest.py").write_text("X = 1 < 2\n")
    return root


def test_mutation_is_seeded_and_touches_only_non_test_code(tmp_path):
    root = _repo(tmp_path)
    sites = find_sites(root, ("pkg",))
    assert {s.file for s in sites} == {"pkg/__init__.py"}
    kinds = {s.kind for s in sites}
    assert {"comparison LessThan -> LessThanEqual", "boolean And -> Or", "boolean drop not", "return True -> False",
            "arithmetic Add -> Subtract", "arithmetic Multiply -> FloorDivide", "augmented AddAssign -> SubtractAssign",
            "integer 2 -> 1", "integer 1 -> 0", "comparison In -> NotIn", "return swap 2 items"} <= kinds
    assert sample_sites(sites, 7) == sample_sites(find_sites(root, ("pkg",)), 7) != sample_sites(sites, 8)
    assert sorted(sample_sites(sites, 7), key=sites.index) == sites  # every site once: no replacement
    mutants = {mutate(SOURCE, s) for s in sites}
    assert len(mutants) == len(sites) and SOURCE not in mutants
    for site in sites:
        mutant = mutate(SOURCE, site)
        assert mutant == mutate(SOURCE, site)
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), mutant.splitlines())) if a != b]
        assert changed == [site.line - 1]  # one line, the site's
