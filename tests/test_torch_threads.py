"""Torch work beside a decoding engine starts no OpenMP thread team of its own
(`flywheel.torch_threads`): while one lives on another thread of the process, the engine's decode
steps on its own thread run slower (docs/experiments/adapters.md)."""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flywheel.models.lora_adapter import read_adapter
from flywheel.torch_threads import one_thread

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2 or not Path("/proc/self/task").is_dir(),
                                reason="needs torch on two or more threads and Linux's /proc")

LAYER = "model.layers.0.mlp.up_proj"
BIG = (1024, 64)
"""B's shape: more elements than torch's grain for one thread (32,768), so its ops run in parallel."""


PROBES = itertools.count()
"""Each count's own OS name for the thread that runs the work (a thread it starts, an OpenMP
team's, inherits it): an earlier count's team may still be ending."""


def threads_named(name: bytes) -> int:
    named = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            named += (task / "comm").read_bytes().rstrip(b"\n") == name
        except OSError:  # the thread ended meanwhile
            pass
    return named


def name_this_thread(name: bytes) -> None:
    ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME


def write_wide_adapter(path: Path) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": BIG[1], "lora_alpha": 2 * BIG[1]}))
    key = f"base_model.model.{LAYER}"
    save_file({f"{key}.lora_A.weight": torch.ones(BIG[1], 256), f"{key}.lora_B.weight": torch.ones(BIG)},
              str(path / "adapter_model.safetensors"))
    return path


def threads_added_by(work) -> int:
    """How many OS threads `work` starts, run on a thread of a pool that stays alive: the threads
    that thread started, not the process's count (other threads of a test session end meanwhile)."""
    name = f"probe-{next(PROBES)}".encode()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(name_this_thread, name).result()
        before = threads_named(name)
        pool.submit(work).result()
        return threads_named(name) - before


def test_a_parallel_op_on_another_thread_starts_a_team_of_its_own():
    """The hazard itself, so that the tests below can fail: the same op outside `one_thread`, on a
    thread computing on two (a new thread starts at the count the process was last set to: an
    in-process serve loop of an earlier test, on cores it shares, leaves it at one)."""
    wide = torch.ones(BIG)

    def doubled() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            wide.mul(2.0)
        finally:
            torch.set_num_threads(threads)

    assert threads_added_by(doubled) >= 1


def test_a_thread_of_the_process_that_ends_meanwhile_is_not_counted():
    """The count itself: in a whole test session threads of earlier tests end while the work runs
    (CI at d38e300 counted -2)."""
    ending = threading.Event()
    other = threading.Thread(target=ending.wait)
    other.start()
    assert threads_added_by(lambda: (ending.set(), other.join())) == 0


def test_work_in_one_thread_starts_no_team_and_leaves_the_thread_count_as_it_was():
    wide = torch.ones(BIG)

    def doubled() -> tuple[int, int]:
        before = torch.get_num_threads()  # this thread's own count: a thread keeps its own
        with one_thread():
            assert torch.get_num_threads() == 1
            wide.mul(2.0)
        return before, torch.get_num_threads()

    counts = []
    assert threads_added_by(lambda: counts.append(doubled())) == 0
    [(before, after)] = counts
    if before < 2:
        pytest.skip("a new thread of this process starts at one intra-op thread: nothing to restore")
    assert after == before


def test_reading_an_adapter_beside_an_engine_starts_no_team(tmp_path):
    """The engine reads a newly loaded adapter on a worker thread (`AdapterCommands.load_adapter`);
    a rank-32 adapter of SmolLM2 has B matrices this wide."""
    path = write_wide_adapter(tmp_path / "wide")
    read = []
    assert threads_added_by(lambda: read.append(read_adapter(path))) == 0
    a, b = read[0].layers[LAYER]
    assert a.shape == (BIG[1], 256) and torch.equal(b, torch.full(BIG, 2.0))  # read, the scaling folded in
