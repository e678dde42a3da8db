"""What a busy vLLM CPU server does to the other processes on a small machine, with its model's
worker pinned to one core (vLLM's default, `VLLM_CPU_OMP_THREADS_BIND=auto`) and unpinned
(`nobind`, what `flywheel.serve.backends.vllm_server` starts it with), both measured in one run.

What it measures
    For each binding: a vLLM server (the CPU build in `.venv-vllm`, `tiny`, started as the serve
    loop starts it) with background load in loops, plain httpx straight at its
    `/inference/v1/generate`: `--streams` streams of 48 tokens and `--whole` whole answers of 384
    tokens (`ignore_eos`, one sampled log-prob each). After 3 s, two things at once:
    - a bystander: a separate Python process that sleeps 10 ms at a time for `--watch-s` seconds
      and reports how long it waited, runnable, for a core (its run-queue wait, from
      `/proc/self/schedstat`) and the longest gap between two of its wake-ups;
    - `--probes` probes one after another: streams of 2,048 tokens; for each, seconds to its
      response headers and to its first event, and its total time.
    And the load's throughput (tokens it received per second) over the same window.

Run: `.venv/bin/python bench/vllm_first_event.py` (about 3 minutes). Results:
`docs/benchmarks.md` ("Odd things found on the way", 5) and
`bench/results/vllm_first_event.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import median, table, write_result  # noqa: E402
from flywheel.serve.backends.vllm_server import VLLMServer  # noqa: E402

BYSTANDER = """
import sys, time
def schedstat():
    on_cpu, waiting, _ = open("/proc/self/schedstat").read().split()
    return int(waiting) / 1e9
end = time.monotonic() + float(sys.argv[1]); last = time.monotonic(); longest = 0.0; waited = schedstat()
while time.monotonic() < end:
    time.sleep(0.01)
    now = time.monotonic(); longest = max(longest, now - last); last = now
print(schedstat() - waited, longest)
"""


def body(tokens: int, stream: bool, rid: str) -> dict:
    return {"token_ids": [5, 6, 7], "request_id": rid, "output_mode": "text", "stream": stream,
            "sampling_params": {"max_tokens": tokens, "ignore_eos": True, "logprobs": 0}}


async def stream(http: httpx.AsyncClient, tokens: int, rid: str, counted: list[int]) -> dict:
    started, first = time.monotonic(), None
    async with http.stream("POST", "/inference/v1/generate", json=body(tokens, True, rid)) as response:
        headers = time.monotonic() - started
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.monotonic() - started
                counted[0] += sum(len(choice.get("token_ids") or []) for choice in json.loads(line[6:]).get("choices", []))
    return {"headers_s": round(headers, 3), "first_event_s": round(first or 0.0, 3), "total_s": round(time.monotonic() - started, 2)}


async def measure(url: str, streams: int, whole: int, probes: int, watch_s: float) -> dict:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    counted = [0]  # the load's tokens
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        done = asyncio.Event()

        async def user(i: int, is_stream: bool) -> None:
            k = 0
            while not done.is_set():
                k += 1
                if is_stream:
                    await stream(http, 48, f"s{i}-{k}", counted)
                else:
                    response = await http.post("/inference/v1/generate", json=body(384, False, f"w{i}-{k}"))
                    response.raise_for_status()
                    counted[0] += sum(len(c["token_ids"]) for c in response.json()["choices"])

        load = [asyncio.create_task(user(i, i < streams)) for i in range(streams + whole)]
        await asyncio.sleep(3)  # the load is running
        bystander = await asyncio.create_subprocess_exec(sys.executable, "-c", BYSTANDER, str(watch_s), stdout=subprocess.PIPE)
        started, tokens_then = time.monotonic(), counted[0]
        results = [await stream(http, 2048, f"probe{k}", [0]) for k in range(probes)]
        waited, longest = map(float, (await bystander.communicate())[0].split())
        load_tok_s = (counted[0] - tokens_then) / (time.monotonic() - started)
        done.set()
        await asyncio.gather(*load)
    return {"probes": results, "bystander_wait_s": round(waited, 2), "bystander_watch_s": watch_s,
            "bystander_longest_gap_s": round(longest, 2), "load_tok_s": round(load_tok_s, 1)}


def run(binding: str, args: argparse.Namespace) -> dict:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding  # VLLMServer passes VLLM_* variables through
    server = VLLMServer("tiny", "tiny", Path(tempfile.mkdtemp(prefix=f"vllm-first-event-{binding}-")))
    url = server.start()
    try:
        return asyncio.run(measure(url, args.streams, args.whole, args.probes, args.watch_s))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bindings", default="auto,nobind", help="values of VLLM_CPU_OMP_THREADS_BIND, each a server")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--whole", type=int, default=4)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--watch-s", type=float, default=20.0, help="the bystander's time (within the probes')")
    args = parser.parse_args()
    results = {binding: run(binding, args) for binding in args.bindings.split(",")}
    rows = []
    for binding, r in results.items():
        headers = [p["headers_s"] for p in r["probes"]]
        rows.append([binding, r["bystander_wait_s"], r["bystander_longest_gap_s"], median(headers), max(headers),
                     r["load_tok_s"], " ".join(str(p["total_s"]) for p in r["probes"])])
    print(table(["binding", f"bystander waited s (of {args.watch_s:g})", "its longest gap s", "probe headers p50 s",
                 "max s", "load tok/s", "probe totals s"], rows))
    print(f"wrote {write_result('vllm_first_event', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
