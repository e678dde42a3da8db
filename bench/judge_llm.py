"""An `llm` judge against the embedded engine: trajectories judged per second at its concurrency
limit, with the parse rate and the per-request latency.

What it measures
    A serve loop with the embedded engine (`--model`, default `tiny`) is the judge's endpoint,
    as in a deployment that judges with its own policy. A judge loop (`judge.kind=llm`,
    `judge.llm.max_concurrency` = `--concurrency` requests in flight, k = `--votes` votes per
    turn, `--max-tokens` per vote, default prompts) consumes N trajectories of two arithmetic
    turns each from the bus, all published at once, so the judge runs at its concurrency limit
    throughout. Timed: from the first publish until every trajectory has been published back as
    a sample or an unscored report. One trajectory is judged first, untimed (warm-up).

    Reported: trajectories judged per second (samples and unscored together), judge requests per
    second, generated tokens per second (from the serve loop's recorded side turns), the parse
    rate (votes with a valid score / votes), how many trajectories were scored and unscored
    (by reason), and per-request latency (p50, p99): one HTTP request as the judge's client saw
    it, from sending to the whole reply (not the wait for a concurrency slot). `tiny` is a
    random model: its replies rarely hold a score, so nearly all its trajectories are unscored;
    the plumbing and the cost are real. SmolLM2 is a real (weak) chat model.

    The timed phase first waits (up to 90 s) until other processes use under 0.25 cores, holds
    /tmp/flywheel-bench.lock while it runs, and records the CPU other processes used meanwhile.

How to run (from the repository root)
    .venv/bin/python bench/judge_llm.py                          # tiny: 32 trajectories
    .venv/bin/python bench/judge_llm.py --model smollm2-135m     # 8 trajectories
    options: --trajectories N --concurrency C --votes K --max-tokens T --threads T
    Writes bench/results/judge_llm_<model>_c<concurrency>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    CpuWatch,
    machine,
    percentile,
    quiet_logs,
    table,
    wait_quiet_async,
    write_result,
)
from bench.lib.served import Served  # noqa: E402

LOCK = Path("/tmp/flywheel-bench.lock")
DEFAULTS = {"tiny": {"trajectories": 32}, "smollm2-135m": {"trajectories": 8}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--trajectories", type=int)
    p.add_argument("--concurrency", type=int, default=8, help="judge.llm.max_concurrency (default 8, the config default)")
    p.add_argument("--votes", type=int, default=3, help="judge.llm.votes (default 3)")
    p.add_argument("--max-tokens", type=int, default=256, help="judge.llm.max_tokens (default 256)")
    p.add_argument("--threads", type=int, default=1, help="serve.torch_threads (default 1, the config default)")
    args = p.parse_args()
    args.trajectories = args.trajectories or DEFAULTS.get(args.model, DEFAULTS["smollm2-135m"])["trajectories"]
    return args


def arithmetic_trajectory(tid: str, a: int, b: int):
    """Two assistant turns: a sum (answered right) and a product (answered wrong when a is odd)."""
    from flywheel.bus import Trajectory, Turn

    system = {"role": "system", "content": "You are a calculator. Answer with the number only."}
    ask = {"role": "user", "content": f"What is {a} + {b}?"}
    first = {"role": "assistant", "content": str(a + b)}
    follow = {"role": "user", "content": "Now multiply that by 3."}
    second = {"role": "assistant", "content": str((a + b) * 3 + a % 2)}
    histories = [[system, ask], [system, ask, first, follow]]
    turns = [
        Turn(id=f"{tid}-{i}", session_id=tid, turn_index=i, task_id=f"sum-{a}-{b}", model="policy", messages=history,
             response=response, prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], output_versions=[0], finish_reason="stop")
        for i, (history, response) in enumerate(zip(histories, [first, second]))
    ]
    return Trajectory(id=tid, session_id=tid, task_id=f"sum-{a}-{b}", segments=[], turns=turns,
                      next_states=[[follow], []], close_reason="done")


@contextlib.contextmanager
def bench_lock():
    """Hold /tmp/flywheel-bench.lock (waiting while someone else holds it)."""
    while True:
        try:
            os.close(os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            time.sleep(5)
    try:
        yield
    finally:
        LOCK.unlink(missing_ok=True)


class TimedRequests:
    """Wraps the judge client's `chat.completions.create` to record each HTTP request's latency
    (from sending to the whole reply; not the wait for a concurrency slot)."""

    def __init__(self, client):
        self.latencies: list[float] = []
        self._create = client.chat.completions.create
        client.chat.completions.create = self.create

    async def create(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await self._create(*args, **kwargs)
        finally:
            self.latencies.append(time.perf_counter() - started)


async def judge_all(loop, bus, trajectories, expected_total: int) -> float:
    from flywheel.bus import TRAJECTORY_SUBJECT

    started = time.perf_counter()
    for trajectory in trajectories:
        await bus.publish(TRAJECTORY_SUBJECT, trajectory)
    while loop.stats()["scored"] + loop.stats()["unscored"] < expected_total:
        await asyncio.sleep(0.01)
    return time.perf_counter() - started


async def run(args: argparse.Namespace) -> dict:
    from flywheel.bus import Bus
    from flywheel.config import load_config
    from flywheel.judge.loop import JudgeLoop

    async with Served(args.model, [f"serve.torch_threads={args.threads}", "serve.max_batch_size=32"]) as served:
        config = load_config(None, [
            f"run_dir={served.tmp / 'run'}", f"model={args.model}", "judge.kind=llm", "judge.llm.source=policy",
            "judge.llm.mode=score", "judge.teacher.enabled=false",  # what the recorded numbers measured
            f"judge.llm.max_concurrency={args.concurrency}", f"judge.llm.votes={args.votes}",
            f"judge.llm.max_tokens={args.max_tokens}", "judge.deadline_s=3000",
        ])
        loop = JudgeLoop(config, served.nats_url)
        await loop.start()
        bus = await Bus.connect(served.nats_url, name="bench")
        try:
            await judge_all(loop, bus, [arithmetic_trajectory("warm-up", 1, 2)], 1)
            timer = TimedRequests(loop.judge.endpoint.client)
            before, tokens_before = loop.stats(), dict(served.loop.stats()["engine"])
            quiet = await wait_quiet_async()
            trajectories = [arithmetic_trajectory(f"t{i}", 3 + i, 11 + 2 * i) for i in range(args.trajectories)]
            with bench_lock():
                watch = CpuWatch().start()
                wall = await judge_all(loop, bus, trajectories, 1 + args.trajectories)
                cpu = watch.stop()
            after, tokens_after = loop.stats(), dict(served.loop.stats()["engine"])
        finally:
            await bus.close()
            await loop.stop()
    judge_before, judge_after = before["judge"], after["judge"]
    requests = judge_after["requests"] - judge_before["requests"]
    votes = judge_after["votes"] - judge_before["votes"]
    valid = judge_after["valid_votes"] - judge_before["valid_votes"]
    unscored = {k: v - before["unscored_by_reason"].get(k, 0) for k, v in after["unscored_by_reason"].items()}
    tokens = tokens_after["tokens"] - tokens_before["tokens"]
    steps = tokens_after["steps"] - tokens_before["steps"]
    return {
        "trajectories": args.trajectories, "turns": 2 * args.trajectories, "wall_s": wall,
        "trajectories_per_s": args.trajectories / wall, "turns_per_s": 2 * args.trajectories / wall,
        "requests": requests, "requests_per_s": requests / wall, "retries": judge_after["retries"] - judge_before["retries"],
        "votes": votes, "valid_votes": valid, "parse_rate": valid / votes if votes else None,
        "scored": after["scored"] - before["scored"], "unscored": {k: v for k, v in unscored.items() if v},
        "latency_p50_s": percentile(timer.latencies, 50), "latency_p99_s": percentile(timer.latencies, 99),
        "generated_tokens": tokens, "tokens_per_s": tokens / wall, "mean_decode_batch": tokens / steps if steps else None,
        "quiet_wait": quiet, "cpu": cpu,
    }


def main() -> None:
    args = parse_args()
    quiet_logs()
    logging.getLogger("flywheel.judge.loop").setLevel(logging.ERROR)  # one warning per unscored trajectory
    result = asyncio.run(run(args))
    print(table(
        ["model", "traj", "conc", "k", "max_tok", "traj/s", "turns/s", "req/s", "tok/s", "parse rate", "scored", "p50 s",
         "p99 s", "foreign cores"],
        [[args.model, args.trajectories, args.concurrency, args.votes, args.max_tokens, result["trajectories_per_s"],
          result["turns_per_s"], result["requests_per_s"], result["tokens_per_s"], result["parse_rate"], result["scored"],
          result["latency_p50_s"], result["latency_p99_s"], result["cpu"]["foreign_cores"]]],
    ))
    print("unscored by reason:", result["unscored"])
    settings = {k: getattr(args, k) for k in ("model", "trajectories", "concurrency", "votes", "max_tokens", "threads")}
    path = write_result(f"judge_llm_{args.model}_c{args.concurrency}", {"settings": settings, "machine": machine(args.threads), "result": result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
