"""How many torch intra-op threads the embedded engine computes on (`serve.torch_threads`).

A gateway alone on its machine should use every core it may: the engine's decode step is its
work, and one thread leaves the rest of a CPU idle (docs/experiments/engine-vs-vllm.md). "May" is the
process's CPU affinity, bounded by a cgroup v2 CPU quota when the container has one
(`docker run --cpus`), which torch's own default does not read: in a container given two of a
machine's sixty-four cores by quota, it would start sixty-four threads.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def torch_threads(requested: int | None) -> int:
    """`requested`, or every core this process may use."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = CPU_MAX.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores
