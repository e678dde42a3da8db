"""Turn records through the collect loop and a `rule` judge to scored samples: throughput and
latency.

The collect and judge loops run as their own processes (`flywheel loop collect`, `flywheel loop judge`),
as deployed, against a private nats-server. This process plays the gateways: it publishes
pre-encoded turn records (sessions of `--turns` turns whose prompts grow by the previous output
plus a user message, as an agent's do; token ids, logprobs, versions and message text of
realistic sizes) and one reward per session, and listens for the samples.

1. *Throughput*: `--sessions` sessions published as fast as JetStream takes them (pipelined,
   up to `--window` acknowledgements outstanding, so the stand-in gateways take little of the two
   cores), about `--concurrent` of them open at any time (each starts at a random point; a
   session's records are in order, its reward last), timed from the first publish to the last
   sample: turns per second.
2. *Latency*: sessions published one after another at `--rate` turns/s, each session's reward
   right after its last turn; per session, the time from sending the record that ends it to
   the arrival of its sample (so the wait for a session to end is excluded, as the target
   says): p50 / p99.

Targets (issue 4): >= 5,000 turns/s, p99 <= 100 ms.

    .venv/bin/python bench/collect_judge.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    ROOT,
    CpuWatch,
    machine,
    percentile,
    table,
    wait_quiet_async,
    write_result,
)
from flywheel.bus import (  # noqa: E402
    SAMPLE_SUBJECT,
    SESSION_EVENT_SUBJECT,
    TURN_SUBJECT,
    Bus,
    EmbeddedNats,
    SessionEvent,
    Turn,
    encode,
)
from flywheel.cli import command  # noqa: E402

WORDS = "the cat sat on a mat and then it ran off to find some food in the big old house".split()


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens * 3 // 4)))


def session_records(sid: str, turns: int, rng: random.Random) -> list[tuple[str, str, bytes]]:
    """(subject, record id, payload) of one session: its turns, then its reward."""
    out = []
    prompt = [rng.randrange(50_000) for _ in range(rng.randint(200, 600))]
    messages = [{"role": "system", "content": text(rng, 60)}, {"role": "user", "content": text(rng, 150)}]
    for index in range(turns):
        output = [rng.randrange(50_000) for _ in range(rng.randint(30, 200))]
        turn = Turn(
            id=f"{sid}-{index}", session_id=sid, turn_index=index, model="bench", messages=list(messages),
            response={"role": "assistant", "content": text(rng, len(output))}, prompt_ids=list(prompt),
            output_ids=output, output_logprobs=[-rng.random() for _ in output], output_versions=[3] * len(output),
            finish_reason="stop", task_id=sid,
        )
        out.append((TURN_SUBJECT, turn.id, encode(turn)))
        messages += [turn.response, {"role": "user", "content": text(rng, 40)}]
        prompt = prompt + output + [rng.randrange(50_000) for _ in range(40)]
    reward = SessionEvent(id=f"{sid}-reward", session_id=sid, kind="feedback", reward=rng.random(), source="env")
    out.append((SESSION_EVENT_SUBJECT, reward.id, encode(reward)))
    return out


def start_loops(url: str, run_dir: Path) -> list[subprocess.Popen]:
    common = [f"bus.url={url}", f"run_dir={run_dir}", "collect.feedback_grace_s=0", "judge.kind=rule"]
    return [subprocess.Popen(command("loop", name, *common), cwd=ROOT) for name in ("collect", "judge")]


class Samples:
    """Arrival time of every sample, by id (read from the message header: no decoding)."""

    def __init__(self):
        self.arrived: dict[str, float] = {}
        self.changed = asyncio.Event()

    async def on_message(self, msg) -> None:
        self.arrived[msg.headers["Nats-Msg-Id"]] = time.perf_counter()
        self.changed.set()

    async def wait_for(self, n: int, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while len(self.arrived) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.01, deadline - time.perf_counter()))


async def publish(bus: Bus, record: tuple[str, str, bytes]) -> None:
    subject, rid, payload = record
    await bus.js.publish(subject, payload, headers={"Nats-Msg-Id": rid})


async def publish_pipelined(bus: Bus, record: tuple[str, str, bytes]) -> asyncio.Future:
    """Send a record; the returned future completes with JetStream's acknowledgement."""
    subject, rid, payload = record
    return await bus.js.publish_async(subject, payload, headers={"Nats-Msg-Id": rid})


def interleave(sessions: list[list[tuple[str, str, bytes]]], concurrent: int, rng: random.Random) -> list:
    """All records in one arrival order with about `concurrent` sessions open at any time: each
    session starts at a random point and its records follow `concurrent` records apart."""
    span = len(sessions) * len(sessions[0]) / concurrent
    timed = []
    for records in sessions:
        start = rng.uniform(0, span)
        timed += [(start + k, i, record) for k, (i, record) in enumerate(enumerate(records))]
    return [record for _, _, record in sorted(timed, key=lambda t: (t[0], t[1]))]


async def throughput(bus: Bus, samples: Samples, sessions: list[list[tuple[str, str, bytes]]], window: int,
                     concurrent: int) -> dict:
    order = interleave(sessions, concurrent, random.Random(1))
    n_turns = sum(len(s) - 1 for s in sessions)
    watch = CpuWatch().start()
    started = time.perf_counter()
    for i in range(0, len(order), window):  # pipelined, `window` PubAcks outstanding at most
        await asyncio.gather(*[await publish_pipelined(bus, r) for r in order[i:i + window]])
    published = time.perf_counter()
    await samples.wait_for(len(sessions), timeout_s=600)
    finished = max(samples.arrived.values())
    return {"turns": n_turns, "sessions": len(sessions), "publish_s": published - started, "total_s": finished - started,
            "turns_per_s": n_turns / (finished - started), "cpu": watch.stop()}


async def latency(bus: Bus, samples: Samples, sessions: list[list[tuple[str, str, bytes]]], rate: float) -> dict:
    ended_at: dict[str, float] = {}
    watch = CpuWatch().start()
    started = time.perf_counter()
    sent = 0
    for records in sessions:
        for record in records:
            if record[0] == TURN_SUBJECT:
                sent += 1
                delay = started + sent / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                ended_at[record[1].removesuffix("-reward")] = time.perf_counter()
            await publish(bus, record)
    return {"ended_at": ended_at, "sent_turns": sent, "send_s": time.perf_counter() - started, "cpu": watch.stop()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=20000, help="sessions in the throughput phase")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--window", type=int, default=512, help="publishes in flight at once (throughput phase)")
    parser.add_argument("--concurrent", type=int, default=1000, help="sessions open at once (throughput phase)")
    parser.add_argument("--rate", type=float, default=2000.0, help="turns/s in the latency phase")
    parser.add_argument("--latency-sessions", type=int, default=1000)
    args = parser.parse_args()

    rng = random.Random(0)
    bulk = [session_records(f"bulk{i}", args.turns, rng) for i in range(args.sessions)]
    paced = [session_records(f"paced{i}", args.turns, rng) for i in range(args.latency_sessions)]
    turn_bytes = [len(r[2]) for s in bulk[:200] for r in s if r[0] == TURN_SUBJECT]

    with tempfile.TemporaryDirectory(prefix="bench-collect-") as tmp:
        nats = EmbeddedNats(Path(tmp) / "nats")
        url = nats.start()
        bus = await Bus.connect(url, name="bench")
        loops = start_loops(url, Path(tmp) / "run")
        samples = Samples()
        await bus.nc.subscribe(SAMPLE_SUBJECT, cb=samples.on_message)
        try:
            # Warm-up: both loops connected and through their first records.
            warm = [session_records(f"warm{i}", args.turns, rng) for i in range(20)]
            for records in warm:
                for record in records:
                    await publish(bus, record)
            await samples.wait_for(len(warm), timeout_s=120)
            quiet = await wait_quiet_async()
            samples.arrived.clear()
            bulk_result = await throughput(bus, samples, bulk, args.window, args.concurrent)
            samples.arrived.clear()
            paced_result = await latency(bus, samples, paced, args.rate)
            await samples.wait_for(len(paced), timeout_s=600)
        finally:
            for proc in loops:
                proc.terminate()
            for proc in loops:
                proc.wait(timeout=30)
            await bus.close()
            nats.stop()

    ended_at = paced_result.pop("ended_at")
    arrived = {sample_id.split("#", 1)[0]: t for sample_id, t in samples.arrived.items()}  # sample id: SESSION#digest
    delays_ms = [(arrived[sid] - ended_at[sid]) * 1000 for sid in ended_at]
    result = {
        "args": vars(args), "machine": machine(None), "quiet_before": quiet, "turn_record_bytes_mean": sum(turn_bytes) / len(turn_bytes),
        "throughput": bulk_result,
        "latency": {**paced_result, "p50_ms": percentile(delays_ms, 50), "p99_ms": percentile(delays_ms, 99),
                    "max_ms": max(delays_ms), "sessions": len(delays_ms)},
    }
    path = write_result("collect_judge", result)
    print(table(
        ["phase", "turns", "sessions", "wall s", "turns/s", "p50 ms", "p99 ms", "foreign cores"],
        [["throughput", bulk_result["turns"], bulk_result["sessions"], bulk_result["total_s"], bulk_result["turns_per_s"],
          None, None, bulk_result["cpu"]["foreign_cores"]],
         ["latency", paced_result["sent_turns"], len(delays_ms), paced_result["send_s"], args.rate,
          result["latency"]["p50_ms"], result["latency"]["p99_ms"], paced_result["cpu"]["foreign_cores"]]],
    ))
    print(f"results: {path}")


if __name__ == "__main__":
    asyncio.run(main())
