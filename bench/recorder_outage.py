"""The gateway's recorder during a bus outage: how many turns a second it makes durable on disk,
and how long its event loop stalls meanwhile.

While the bus is away, every record the gateway makes goes to an append-only spill file, and a
client hears back (`durable`) once its record is fsync'd (flywheel/serve/recorder.py). The records
spilled in one turn of the event loop share one fsync (a group commit); the baseline, in the same
run, fsyncs each record as it is handed over (what the recorder did before). `--callers`
concurrent callers (streams ending) each make `--records` records durable one after another; a
ticker task measures the longest gap between its 1 ms sleeps (the stall every other request
sees). Then one burst of `--burst` `record()` calls, as a loaded gateway makes them: the time the
event loop spends in them.

    .venv/bin/python bench/recorder_outage.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import machine, quiet_logs, table, write_result  # noqa: E402
from flywheel.bus import TURN_SUBJECT, Bus, EmbeddedNats, Turn  # noqa: E402
from flywheel.serve.recorder import Recorder  # noqa: E402


class FsyncEach(Recorder):
    """The baseline: each spilled record fsync'd as it is handed over."""

    def _sync_soon(self) -> None:
        self._sync()


def turn(i: int) -> Turn:
    """A turn of a 200-token prompt and a 64-token reply (about 3 KB on disk)."""
    return Turn(id=f"t{i}", session_id=f"s{i % 64}", turn_index=i, model="tiny", consent=True,
                messages=[{"role": "user", "content": "x" * 400}], response={"role": "assistant", "content": "y" * 200},
                prompt_ids=list(range(200)), output_ids=list(range(64)), output_logprobs=[-0.5] * 64,
                output_versions=[0] * 64, finish_reason="stop")


async def outage(kind: type[Recorder], args, spill: Path) -> dict:
    """One arm: its recorder on a bus that went away, the callers, the ticker, the burst."""
    nats = EmbeddedNats(spill / "nats")
    bus = await Bus.connect(nats.start(), name=kind.__name__)
    nats.stop()
    while bus.nc.is_connected:
        await asyncio.sleep(0.01)
    recorder = kind(bus, spill_dir=spill / "spill")
    longest, running = 0.0, True

    async def ticker() -> None:
        nonlocal longest
        while running:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            longest = max(longest, time.perf_counter() - before - 0.001)

    async def caller(c: int) -> None:
        for r in range(args.records):
            await recorder.durable(TURN_SUBJECT, turn(c * args.records + r))

    ticking = asyncio.create_task(ticker())
    began = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in range(args.callers)))
    seconds = time.perf_counter() - began
    running = False
    await ticking
    began = time.perf_counter()
    assert all(recorder.record(TURN_SUBJECT, turn(10**6 + i)) for i in range(args.burst))
    burst = time.perf_counter() - began
    await asyncio.sleep(0)  # the burst's fsync, where one is due
    await bus.close()
    return {"records_per_s": args.callers * args.records / seconds, "longest_stall_ms": 1000 * longest,
            "burst_ms": 1000 * burst, "spilled": recorder.spilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--records", type=int, default=20)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="recorder_outage")
    args = parser.parse_args()
    quiet_logs()
    runs: dict[str, list[dict]] = {"fsync each": [], "group commit": []}
    for _ in range(args.repeats):  # the arms alternate, so a noisy neighbour falls on both
        for arm, kind in (("fsync each", FsyncEach), ("group commit", Recorder)):
            with tempfile.TemporaryDirectory() as spill:
                runs[arm].append(asyncio.run(outage(kind, args, Path(spill))))
    best = {arm: {key: (max if key == "records_per_s" else min)(r[key] for r in rs) for key in rs[0] if key != "spilled"}
            for arm, rs in runs.items()}
    ratio = best["group commit"]["records_per_s"] / best["fsync each"]["records_per_s"]
    print(table(["arm", "durable records/s", "longest stall (ms)", f"{args.burst} record() calls (ms)"],
                [[arm, f"{b['records_per_s']:.0f}", f"{b['longest_stall_ms']:.1f}", f"{b['burst_ms']:.1f}"]
                 for arm, b in best.items()]))
    print(f"group commit / fsync each: {ratio:.1f}x durable records/s")
    print(f"wrote {write_result(args.name, {'args': vars(args), 'runs': runs, 'best': best, 'ratio': ratio, 'machine': machine(None)})}")


if __name__ == "__main__":
    main()
