"""Streaming load generator (chat completions, or SGLang `/generate`), run as a separate
process by the gateway and hot swap benchmarks (so its own CPU work does not compete for the
server's GIL).

    python bench/lib/stream_client.py CONFIG.json

CONFIG: {"url", "model", "client": "httpx"|"openai"|"raw", "concurrency", "max_tokens",
"messages": [[...], ...] (one conversation per worker, cycled), "logprobs": bool,
"protocol": "openai" (default: streaming `/v1/chat/completions`) | "native" (streaming
SGLang `/generate` with "prompts": [[token ids], ...] (cycled) and incremental output;
"logprobs" sets `return_logprob`; httpx or raw client), "seed": int
(optional: worker w's requests are seeded seed + w, in either protocol),
"mode": "rounds" with "rounds" and "warmup_rounds" | "duration" with "duration_s",
"out": path}. The process prints `ready` once imported and connected, waits for a line on
stdin, runs, writes the per-request records to `out` as JSON and prints `done`.
A `duration` run's workers each send one request after another until the time is up.

Per request it records (time.monotonic(), comparable with the parent on Linux): send time,
the time of every chunk that carries output tokens and how many it carries (with logprobs:
its number of logprobs entries, exact; without: a chunk with text counts 1, approximate), the
finish time, the token count from the usage chunk, the finish reason, the response id, the
fingerprint version of each token chunk (`flywheel-vN`: the version of its last token), and
any error.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time


def _request(cfg: dict, worker: int) -> tuple[str, dict]:
    """The path and JSON body of `worker`'s request."""
    if cfg.get("protocol") == "native":
        return "/generate", {
            "input_ids": cfg["prompts"][worker % len(cfg["prompts"])], "stream": True,
            "return_logprob": bool(cfg.get("logprobs")),
            "sampling_params": {"max_new_tokens": cfg["max_tokens"], "temperature": 1.0, "top_p": 1.0,
                                **({"sampling_seed": cfg["seed"] + worker} if "seed" in cfg else {})},
        }
    return "/v1/chat/completions", _chat_body(cfg, worker)


def _chat_body(cfg: dict, worker: int) -> dict:
    body = {"model": cfg["model"], "messages": cfg["messages"][worker % len(cfg["messages"])], "max_tokens": cfg["max_tokens"],
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.get("logprobs"):
        body["logprobs"] = True
    if "seed" in cfg:
        body["seed"] = cfg["seed"] + worker
    return body


def _record(worker: int, tag: str) -> dict:
    return {"worker": worker, "tag": tag, "t_send": time.monotonic(), "chunks": [], "n": [], "versions": [],
            "t_first": None, "t_finish": None, "tokens": None, "finish_reason": None, "error": None, "done": False}


def _on_event(rec: dict, cfg: dict, payload: str | bytes, now: float) -> bool:
    """Take one SSE `data:` payload; True once it is [DONE]."""
    if payload in ("[DONE]", b"[DONE]"):
        rec["done"] = True
        return True
    chunk = json.loads(payload)
    if "error" in chunk:
        rec["error"] = str(chunk["error"])
        return False
    if cfg.get("protocol") == "native":
        _on_native_chunk(rec, chunk, now)
        return False
    rec["id"] = rec.get("id") or chunk.get("id")
    if chunk.get("usage"):
        rec["tokens"] = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if cfg.get("logprobs"):  # one logprobs entry per token (a chunk may carry text only)
            n = len((choice.get("logprobs") or {}).get("content") or [])
        else:
            n = 1 if delta.get("content") else 0
        if n:
            rec["t_first"] = rec["t_first"] or now
            rec["chunks"].append(now)
            rec["n"].append(n)
            fp = chunk.get("system_fingerprint")
            if fp:
                rec["versions"].append(int(fp.rsplit("v", 1)[1]))
        if choice.get("finish_reason"):
            rec["finish_reason"] = choice["finish_reason"]
            rec["t_finish"] = now
    return False


def _on_native_chunk(rec: dict, chunk: dict, now: float) -> None:
    """One incremental `/generate` chunk: its `output_ids` are the new tokens (exact count)."""
    meta = chunk["meta_info"]
    rec["id"] = meta["id"]
    if chunk["output_ids"]:
        rec["t_first"] = rec["t_first"] or now
        rec["chunks"].append(now)
        rec["n"].append(len(chunk["output_ids"]))
        rec["versions"].append(int(meta["weight_version"]))
    if meta["finish_reason"]:
        rec["finish_reason"] = meta["finish_reason"]["type"]
        rec["t_finish"] = now
        rec["tokens"] = meta["completion_tokens"]


async def one_httpx(http, cfg, worker: int, tag: str) -> dict:
    rec = _record(worker, tag)
    try:
        path, body = _request(cfg, worker)
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and _on_event(rec, cfg, line[6:], time.monotonic()):
                    break
    except Exception as exc:  # recorded: a failed request is a result, not a crash
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def one_raw(cfg, worker: int, tag: str) -> dict:
    """HTTP/1.1 over a plain asyncio connection (one per request), chunked SSE parsed by hand:
    the cheapest client, to keep the load generator's CPU off the server's cores."""
    host, port = cfg["url"].removeprefix("http://").split(":")
    rec = _record(worker, tag)
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        path, body = _request(cfg, worker)
        data = json.dumps(body).encode()
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(data), data))
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status:
            rec["error"] = f"HTTP {status.decode().strip()}: {(await reader.read(200)).decode(errors='replace')}"
            return rec
        if b"transfer-encoding: chunked" not in headers:
            raise RuntimeError("expected a chunked event stream")
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            now = time.monotonic()
            for event in events:
                if event.startswith(b"data: ") and _on_event(rec, cfg, event[6:], now):
                    return rec
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return rec


async def one_openai(client, cfg, worker: int, tag: str) -> dict:
    messages = cfg["messages"][worker % len(cfg["messages"])]
    rec = _record(worker, tag)
    try:
        extra = {"logprobs": True} if cfg.get("logprobs") else {}  # an explicit null would be a 400
        if "seed" in cfg:
            extra["seed"] = cfg["seed"] + worker
        stream = await client.chat.completions.create(
            model=cfg["model"], messages=messages, max_tokens=cfg["max_tokens"], stream=True,
            stream_options={"include_usage": True}, **extra,
        )
        async for chunk in stream:
            now = time.monotonic()
            rec["id"] = rec.get("id") or chunk.id
            if chunk.usage:
                rec["tokens"] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if cfg.get("logprobs"):
                    n = len((choice.logprobs.content or []) if choice.logprobs else [])
                else:
                    n = 1 if choice.delta.content else 0
                if n:
                    rec["t_first"] = rec["t_first"] or now
                    rec["chunks"].append(now)
                    rec["n"].append(n)
                    if chunk.system_fingerprint:
                        rec["versions"].append(int(chunk.system_fingerprint.rsplit("v", 1)[1]))
                if choice.finish_reason:
                    rec["finish_reason"] = choice.finish_reason
                    rec["t_finish"] = now
        rec["done"] = True
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def main(cfg: dict) -> None:
    conc = cfg["concurrency"]
    http = None
    if cfg.get("client", "httpx") == "raw":
        one = lambda w, tag: one_raw(cfg, w, tag)  # noqa: E731
    elif cfg.get("client", "httpx") == "openai":
        if cfg.get("protocol") == "native":
            raise SystemExit("the openai client speaks the OpenAI protocol only")
        import httpx
        from openai import AsyncOpenAI

        http = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8))
        client = AsyncOpenAI(base_url=cfg["url"] + "/v1", api_key="unused", http_client=http, max_retries=0)
        one = lambda w, tag: one_openai(client, cfg, w, tag)  # noqa: E731
    else:
        import httpx

        http = httpx.AsyncClient(base_url=cfg["url"], timeout=600,
                                 limits=httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8))
        one = lambda w, tag: one_httpx(http, cfg, w, tag)  # noqa: E731
    if http is not None:
        await http.get(cfg["url"] + "/health")
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    records: list[dict] = []
    rounds: list[dict] = []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    if cfg["mode"] == "rounds":
        for r in range(cfg.get("warmup_rounds", 0) + cfg["rounds"]):
            tag = "warmup" if r < cfg.get("warmup_rounds", 0) else f"round{r}"
            started = time.monotonic()
            batch = await asyncio.gather(*(one(w, tag) for w in range(conc)))
            rounds.append({"tag": tag, "start": started, "end": time.monotonic()})
            records += batch
    else:
        deadline = time.monotonic() + cfg["duration_s"]

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                records.append(await one(w, f"w{w}r{i}"))
                i += 1

        await asyncio.gather(*(worker(w) for w in range(conc)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if http is not None:
        await http.aclose()
    with open(cfg["out"], "w") as f:
        json.dump({"records": records, "rounds": rounds,
                   "client_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}, f)
    print("done", flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        asyncio.run(main(json.load(f)))
