"""Streams straight into an engine, in the server's own event loop, recorded as the streaming
client process records its requests (`bench/lib/stream_client.py`: send time, each token chunk's
time and size, first-token and finish times, token count): `engine.stream` with no protocol
layer (`direct_stream`), or the protocol layer the gateway calls (`native_stream`), run as the
client process runs its load (`in_process_load`). The gateway benchmark's in-process paths."""

from __future__ import annotations

import asyncio
import time
import uuid


def new_record(tag: str) -> dict:
    return {"tag": tag, "t_send": time.monotonic(), "chunks": [], "n": [], "t_first": None, "t_finish": None,
            "tokens": None, "finish_reason": None, "error": None, "done": False}


async def direct_stream(engine, ids: list[int], max_tokens: int, seed: int, tag: str) -> dict:
    from flywheel.serve.engine import SamplingParams, TokenDelta

    rec = new_record(tag)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, top_p=1.0, sampling_seed=seed)
    try:
        async for item in engine.stream(ids, params):
            now = time.monotonic()
            if isinstance(item, TokenDelta):
                rec["t_first"] = rec["t_first"] or now
                rec["chunks"].append(now)
                rec["n"].append(len(item.token_ids))
            else:
                rec["t_finish"], rec["tokens"], rec["finish_reason"] = now, len(item.output_ids), item.finish_reason["type"]
        rec["done"] = True
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def native_stream(client, ids: list[int], max_tokens: int, seed: int, tag: str) -> dict:
    rec = new_record(tag)
    sampling = {"max_new_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "sampling_seed": seed}
    body = {"input_ids": ids, "sampling_params": sampling,
            "return_logprob": True, "top_logprobs_num": 0, "rid": uuid.uuid4().hex}
    try:
        async for chunk in client.generate_stream(body):
            now = time.monotonic()
            if chunk["output_ids"]:
                rec["t_first"] = rec["t_first"] or now
                rec["chunks"].append(now)
                rec["n"].append(len(chunk["output_ids"]))
            meta = chunk["meta_info"]
            if meta.get("finish_reason"):
                rec["t_finish"], rec["tokens"], rec["finish_reason"] = now, meta["completion_tokens"], meta["finish_reason"]["type"]
        rec["done"] = True
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def in_process_load(make, prompts: list[list[int]], seed: int, load: dict) -> dict:
    """Run `load` (the client process's load config: {"mode": "rounds", "rounds",
    "warmup_rounds"} or {"mode": "duration", "duration_s"}) through `make(ids, seed, tag)` in
    this event loop, as the client process runs it over HTTP: {"records", "walls"}."""
    records, walls = [], []
    if load["mode"] == "duration":
        deadline = time.monotonic() + load["duration_s"]

        async def worker(i: int) -> None:
            while time.monotonic() < deadline:
                records.append(await make(prompts[i], seed + i, f"w{i}"))

        await asyncio.gather(*(worker(i) for i in range(len(prompts))))
        return {"records": records, "walls": [steady_wall(records)]}
    warmup = load["warmup_rounds"]
    for r in range(warmup + load["rounds"]):
        tag = "warmup" if r < warmup else f"round{r}"
        started = time.monotonic()
        batch = await asyncio.gather(*(make(ids, seed + i, tag) for i, ids in enumerate(prompts)))
        if r >= warmup:
            walls.append(time.monotonic() - started)
        records += batch
    return {"records": records, "walls": walls}


def steady_wall(records: list[dict]) -> float:
    """A steady block's wall time: from its first request's start to its last stream's end."""
    return max(r["t_finish"] or r["t_send"] for r in records) - min(r["t_send"] for r in records)
