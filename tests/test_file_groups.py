"""`make test`'s workers: each test file whole in one worker, and each group of the files that
start Ray clusters whole in one (`file_groups.py`), checked on the suite's own files by xdist
run as `make test` runs it, with a plugin that records each test's worker and runs none."""

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from file_groups import RAY_CLUSTERS

HERE = Path(__file__).resolve().parent

RECORD = '''
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Write down which worker has the test, and run nothing of it."""
    with open(os.environ["WHERE"], "a") as out:
        out.write(f"{item.nodeid} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    return True
'''


def make_test_dist() -> str:
    """The `--dist` mode of `make test`'s pytest."""
    return re.search(r"pytest -n \S+ --dist (\w+)", (HERE.parent / "Makefile").read_text()).group(1)


def test_make_test_keeps_a_files_tests_in_one_worker_and_a_group_of_ray_files_in_one(tmp_path):
    (tmp_path / "record_worker.py").write_text(RECORD)
    where = tmp_path / "where.txt"
    files = [*sorted(RAY_CLUSTERS), "test_sft.py"]
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", make_test_dist(),
                          "-p", "record_worker", "-p", "no:cacheprovider", *(f"tests/{f}" for f in files)],
                         cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in where.read_text().splitlines():
        nodeid, worker = line.rsplit(" ", 1)
        workers[Path(nodeid.split("::")[0]).name].add(worker)
    assert set(workers) == set(files)
    assert all(len(held) == 1 for held in workers.values()), dict(workers)
    for group in set(RAY_CLUSTERS.values()):
        assert len({w for name, g in RAY_CLUSTERS.items() if g == group for w in workers[name]}) == 1, dict(workers)
