"""Throughput of one gateway in front of 1 vs 2 engine replicas (issue 15).

Each engine is `flywheel engine` (SGLang's protocol, one torch thread) in a process of its
own; the gateway (`flywheel.serve.loop.ServeLoop` with `serve.engine_urls`) routes each session to one
engine by rendezvous hashing on its id. The load: `--streams` concurrent agents, each its own
session, sending chat turns with a mixed `max_tokens` (16-128) back to back for `--seconds`
after a warm-up. Reported: completion tokens per second and per engine, and the CPU each process
used, so that the limit is visible (this machine has 2 cores: two one-thread engines and the
gateway share them).

    .venv/bin/python -m bench.engine_replicas [--model smollm2-135m] [--streams 32] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.served import Served  # noqa: E402
from flywheel.bus.cluster import free_port  # noqa: E402
from flywheel.cli import command  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def start_engine(model: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*command("engine"), "--model", model, "--port", str(port),
                             "--torch-threads", "1", "--max-running-requests", str(max_batch)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/model_info", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"engine on {url} did not start")
        time.sleep(0.5)


async def load(url: str, model: str, streams: int, seconds: float, warmup_s: float) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    counted = {"tokens": 0, "turns": 0}
    measuring = asyncio.Event()
    stop = asyncio.Event()

    async def agent(i: int) -> None:
        rng = random.Random(i)
        for turn in range(10**9):
            if stop.is_set():
                return
            reply = await client.chat.completions.create(
                model=model, max_tokens=rng.randint(16, 128), temperature=1.0,
                messages=[{"role": "user", "content": f"Tell me about the number {rng.randint(0, 10**6)}."}],
                extra_headers={"X-Session-Id": f"bench-{i}-{turn}", "X-Session-Done": "true"},
            )
            if measuring.is_set() and not stop.is_set():
                counted["tokens"] += reply.usage.completion_tokens
                counted["turns"] += 1

    tasks = [asyncio.create_task(agent(i)) for i in range(streams)]
    await asyncio.sleep(warmup_s)
    measuring.set()
    started = time.monotonic()
    await asyncio.sleep(seconds)
    stop.set()
    wall = time.monotonic() - started
    await asyncio.gather(*tasks)
    await client.close()
    return {"tokens_per_s": round(counted["tokens"] / wall, 1), "turns": counted["turns"], "seconds": round(wall, 1)}


async def measure(model: str, engines: int, streams: int, seconds: float, warmup_s: float) -> dict:
    procs = [start_engine(model, streams) for _ in range(engines)]
    try:
        urls = [url for _, url in procs]
        async with Served(model, [f"serve.engine_urls={json.dumps(urls)}", "serve.max_batch_size=32"]) as served:
            cpu = {p.pid: psutil.Process(p.pid).cpu_times() for p, _ in procs}
            me = psutil.Process().cpu_times()
            result = await load(served.url, model, streams, seconds, warmup_s)
            engine_cpu = [sum(psutil.Process(pid).cpu_times()[:2]) - sum(before[:2]) for pid, before in cpu.items()]
            gateway_cpu = sum(psutil.Process().cpu_times()[:2]) - sum(me[:2])
        total = result["seconds"] + warmup_s
        return {"engines": engines, **result, "tokens_per_s_per_engine": round(result["tokens_per_s"] / engines, 1),
                "engine_cpu_cores": [round(c / total, 2) for c in engine_cpu],
                "gateway_cpu_cores": round(gateway_cpu / total, 2)}
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_replicas", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    args = parser.parse_args()
    runs = [asyncio.run(measure(args.model, n, args.streams, args.seconds, args.warmup_s)) for n in (1, 2)]
    report = {"model": args.model, "streams": args.streams, "cores": psutil.cpu_count(), "runs": runs,
              "speedup_2_vs_1": round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 2)}
    (RESULTS / f"engine_replicas_{args.model}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
