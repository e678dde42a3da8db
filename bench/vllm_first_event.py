"""When does a stream's first event come back from vLLM under load? No gateway: plain httpx
straight at vLLM's `/inference/v1/generate`, as `serve.backends.vllm` calls it.

What it measures
    A vLLM server (the CPU build in `.venv-vllm`, `tiny`, started as the serve loop starts it)
    with background load in loops: `--streams` streams of 48 tokens and `--whole` whole answers
    of 384 tokens (`ignore_eos`, one sampled log-prob each). After 3 s, `--probes` probes one
    after another: streams of 2,048 tokens. For each probe: seconds to its response headers, to
    its first event, the number of events (fewer than its tokens: vLLM merged outputs it could
    not send in time), and its total time. Probes whose headers come seconds late are what
    `tests/test_vllm_engine.py`'s hot-swap test had to work around; where vLLM spends those
    seconds is open (`docs/benchmarks.md`).

Run: `.venv/bin/python bench/vllm_first_event.py` (about a minute). Results:
`docs/benchmarks.md` ("Odd things found on the way").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from serve.backends.vllm_server import VLLMServer


def body(tokens: int, stream: bool, rid: str) -> dict:
    return {"token_ids": [5, 6, 7], "request_id": rid, "output_mode": "text", "stream": stream,
            "sampling_params": {"max_tokens": tokens, "ignore_eos": True, "logprobs": 0}}


async def stream(http: httpx.AsyncClient, tokens: int, rid: str) -> dict:
    started, first, events = time.monotonic(), None, 0
    async with http.stream("POST", "/inference/v1/generate", json=body(tokens, True, rid)) as response:
        headers = time.monotonic() - started
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                if first is None:
                    first = time.monotonic() - started
                json.loads(line[6:])
    return {"headers_s": round(headers, 3), "first_event_s": round(first or 0.0, 3), "events": events,
            "total_s": round(time.monotonic() - started, 2)}


async def measure(url: str, streams: int, whole: int, probes: int) -> list[dict]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        done = asyncio.Event()

        async def user(i: int, is_stream: bool) -> None:
            k = 0
            while not done.is_set():
                k += 1
                if is_stream:
                    await stream(http, 48, f"s{i}-{k}")
                else:
                    (await http.post("/inference/v1/generate", json=body(384, False, f"w{i}-{k}"))).raise_for_status()

        load = [asyncio.create_task(user(i, i < streams)) for i in range(streams + whole)]
        await asyncio.sleep(3)  # the load is running
        results = []
        for k in range(probes):
            results.append(await stream(http, 2048, f"probe{k}"))
            print(results[-1], flush=True)
        done.set()
        await asyncio.gather(*load)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--whole", type=int, default=4)
    parser.add_argument("--probes", type=int, default=5)
    args = parser.parse_args()
    server = VLLMServer("tiny", "tiny", Path(tempfile.mkdtemp(prefix="vllm-first-event-")))
    url = server.start()
    try:
        asyncio.run(measure(url, args.streams, args.whole, args.probes))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
