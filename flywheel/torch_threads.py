"""Torch work beside a decoding engine: one intra-op thread (`one_thread`).

Torch's CPU builds keep one OpenMP thread team per thread that starts a parallel op. Once a
second thread of the process (a loader, a test, a benchmark's main thread) has run one
multi-threaded op, two teams share the cores, and an engine decoding on its own thread runs
slower from then on: ~2x for the tiny model (docs/experiments/odd-things.md, section 1), 12-25 %
for SmolLM2-135M's decode steps on two cores after random rank-32 adapters were drawn on the main
thread (docs/experiments/adapters.md). Work that may run beside an engine does so in `one_thread`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """During the block, torch computes on this thread alone (no OpenMP team is started)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
