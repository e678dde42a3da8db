"""Helpers shared by the benchmark scripts in `bench/`: machine description, a record of how
much CPU other processes used while a benchmark ran (the machine is shared), the model a benchmark
runs (real or seeded random weights, on a device), percentiles, the TPOT and TTFT of streamed
requests, a plain-text table, and writing the JSON result file under `bench/results/`
(`<benchmark>[_<variant>].json`, bench/README.md).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_logs() -> None:
    """Keep library chatter (weight-loading bars, HF warnings) out of the results table."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:
        pass


def machine(torch_threads: int | None) -> dict[str, Any]:
    import torch
    import transformers

    model_name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model_name,
        "torch_threads": torch_threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
    }


def bench_model(spec: str, dtype: str = "float32", device: str = "cpu", random_weights: bool = False, seed: int = 0):
    """(model on `device` in `dtype`, tokenizer): as `flywheel/serve/loop.py` builds the engine's
    model (`load_model(spec, dtype)` then `place`), or with seeded random weights of the shape of
    `spec` (a spec or a directory holding a config and tokenizer: `from_config`; timings with
    `ignore_eos` do not depend on the weights, log-probs do)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from flywheel.models import load_model, place, resolve_model

    path = resolve_model(spec)
    if random_weights:
        tokenizer = AutoTokenizer.from_pretrained(path)
        torch.manual_seed(seed)  # the same weights at every dtype
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        model = model.to(getattr(torch, dtype)).eval()
    else:
        model, tokenizer = load_model(path, getattr(torch, dtype))
    return place(model, device), tokenizer


# ---- CPU used by other processes ---------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, cpu ticks incl. waited-for children, command)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        close = raw.rfind(")")
        comm = raw[raw.find("(") + 1:close]
        fields = raw[close + 2:].split()
        # fields[0] is state; ppid=1, utime=11, stime=12, cutime=13, cstime=14 (0-based here)
        try:
            ppid = int(fields[1])
            ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        except (IndexError, ValueError):
            continue
        table[int(entry.name)] = (ppid, ticks, comm)
    return table


def _busy_ticks() -> int:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return user + nice + system + irq + softirq + steal


def _ours(table: dict[int, tuple[int, int, str]]) -> set[int]:
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    mine, todo = set(), [me]
    while todo:
        pid = todo.pop()
        mine.add(pid)
        todo += children.get(pid, [])
    return mine


class CpuWatch:
    """How many cores processes outside this benchmark's process tree used between `start()`
    and `stop()` (measured from /proc: whole-machine busy time minus our tree's), and which
    ones used the most. The benchmark machine is shared; this says how noisy a phase was."""

    def start(self) -> "CpuWatch":
        self.t0 = time.monotonic()
        self.busy0 = _busy_ticks()
        self.table0 = _proc_table()
        return self

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        busy = _busy_ticks() - self.busy0
        table = _proc_table()
        mine = _ours(table) | _ours(self.table0)
        ours = 0
        foreign: list[tuple[float, int, str]] = []
        for pid, (ppid, ticks, comm) in table.items():
            before = self.table0.get(pid, (0, 0, ""))[1] if pid in self.table0 else 0
            used = max(0, ticks - before)
            if pid in mine:
                ours += used
            elif used:
                foreign.append((used / CLK_TCK, pid, comm))
        foreign_cores = max(0.0, (busy - ours) / CLK_TCK / wall) if wall > 0 else 0.0
        foreign.sort(reverse=True)
        return {
            "wall_s": round(wall, 3),
            "machine_busy_cores": round(busy / CLK_TCK / wall, 3) if wall > 0 else 0.0,
            "ours_cores": round(ours / CLK_TCK / wall, 3) if wall > 0 else 0.0,
            "foreign_cores": round(foreign_cores, 3),
            "top_foreign": [{"pid": pid, "cmd": _cmdline(pid, comm), "cpu_s": round(s, 2)} for s, pid, comm in foreign[:3] if s >= 0.5],
        }


def _cmdline(pid: int, comm: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        raw = ""
    return (raw or comm)[:120]


# ---- numbers -------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no values."""
    if not values:
        return None
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: list[float]) -> float | None:
    return percentile(values, 50)


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds; None (no value) stays None."""
    return None if seconds is None else 1e3 * seconds


# Streamed requests, as the records of `bench/lib/stream_client.py` describe them (send time, the
# time of each chunk carrying tokens, first-token and finish times, token count): the same
# definitions of TPOT and TTFT for every benchmark that streams.

def tpot_s(records: list[dict]) -> list[float]:
    """Time per output token of each request with more than one token: (finish - first token) /
    (tokens - 1), in seconds."""
    return [(r["t_finish"] - r["t_first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1 and r["t_first"]]


def ttft_s(records: list[dict]) -> list[float]:
    """Time to first token of each request that got one, from its send time, in seconds."""
    return [r["t_first"] - r["t_send"] for r in records if r["t_first"]]


def table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda items: "| " + " | ".join(s.ljust(w) for s, w in zip(items, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:
        return None


START_COMMIT = git_commit()  # the code a benchmark imported (HEAD may move while it runs)


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": START_COMMIT,
            "commit_at_finish": git_commit(), **data}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def _foreign_now(sample_s: float) -> float:
    watch = CpuWatch().start()
    time.sleep(sample_s)
    return watch.stop()["foreign_cores"]


async def _foreign_now_async(sample_s: float) -> float:
    import asyncio

    watch = CpuWatch().start()
    await asyncio.sleep(sample_s)
    return watch.stop()["foreign_cores"]


def wait_quiet(threshold: float = 0.25, sample_s: float = 1.0, max_wait_s: float | None = None) -> dict[str, float]:
    """Wait (up to `max_wait_s`) until other processes use less than `threshold` cores, so a
    timed phase does not start while someone else's heavy job runs on this shared machine.
    `BENCH_MAX_WAIT_S` (default 90) changes the limit; `BENCH_NO_WAIT=1` skips the check."""
    max_wait_s = max_wait_s if max_wait_s is not None else float(os.environ.get("BENCH_MAX_WAIT_S", 90))
    if os.environ.get("BENCH_NO_WAIT"):  # for debugging the benchmarks themselves
        return {"waited_s": 0.0, "foreign_cores": -1.0}
    started = time.monotonic()
    while True:
        level = _foreign_now(sample_s)
        if level < threshold or time.monotonic() - started > max_wait_s:
            return {"waited_s": round(time.monotonic() - started, 1), "foreign_cores": level}


async def wait_quiet_async(threshold: float = 0.25, sample_s: float = 1.0, max_wait_s: float | None = None) -> dict[str, float]:
    """`wait_quiet` for code running inside an event loop (a server it hosts keeps running)."""
    max_wait_s = max_wait_s if max_wait_s is not None else float(os.environ.get("BENCH_MAX_WAIT_S", 90))
    if os.environ.get("BENCH_NO_WAIT"):
        return {"waited_s": 0.0, "foreign_cores": -1.0}
    started = time.monotonic()
    while True:
        level = await _foreign_now_async(sample_s)
        if level < threshold or time.monotonic() - started > max_wait_s:
            return {"waited_s": round(time.monotonic() - started, 1), "foreign_cores": level}


def thread_times() -> dict[int, dict[str, float]]:
    """This process's threads: {tid: {"cpu_s", "voluntary_switches", "involuntary_switches"}}."""
    out = {}
    for entry in os.scandir("/proc/self/task"):
        try:
            raw = Path(f"/proc/self/task/{entry.name}/stat").read_text()
            status = Path(f"/proc/self/task/{entry.name}/status").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        row = {"cpu_s": (int(fields[11]) + int(fields[12])) / CLK_TCK, "voluntary_switches": 0, "involuntary_switches": 0}
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                row["voluntary_switches"] = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                row["involuntary_switches"] = int(line.split()[1])
        out[int(entry.name)] = row
    return out


def thread_delta(before: dict, after: dict, named: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per named thread (name -> tid) the change between two `thread_times()`; the rest of the
    process's threads summed as "other"."""
    keys = ("cpu_s", "voluntary_switches", "involuntary_switches")
    out = {name: dict.fromkeys(keys, 0) for name in [*named, "other"]}
    by_tid = {tid: name for name, tid in named.items()}
    for tid, now in after.items():
        then = before.get(tid, dict.fromkeys(keys, 0))
        name = by_tid.get(tid, "other")
        for key in keys:
            out[name][key] += now[key] - then[key]
    return out
