"""Streamed requests over one HTTP route, in a child process of its own (so its CPU work does not
compete with an engine in the parent): the engines benchmark's load (`bench/engines.py`).

`Load(cfg, workdir).run()` starts `python bench/lib/route_load.py CFG.json`, which streams every
request of `cfg` (`url`, `model`, `route`: chat (`/v1/chat/completions`), generate (vLLM's
`/inference/v1/generate`) or completions (`/v1/completions`), `concurrency`, `seed`, `requests`:
{"messages", "prompt_ids", "max_new_tokens"}; optional `signal_after`) and prints its records as
one JSON line: per request, send and first-token times, tokens, the longest gap between two
token chunks and the gaps over 100 ms. It prints `flowing` once `signal_after` token chunks have
arrived (the parent's cue for a swap).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


async def run_load(cfg: dict) -> list[dict]:
    """Stream every request of `cfg` (C at a time); per request: send and first-token times,
    tokens, the longest gap between two token chunks. Prints `flowing` once `signal_after`
    token chunks arrived (the parent's cue for a swap)."""
    import httpx

    seen, signalled = [0], [False]
    sem = asyncio.Semaphore(cfg["concurrency"])

    async def one(http: httpx.AsyncClient, i: int, req: dict) -> dict:
        async with sem:
            path, body = _body(cfg, i, req)
            rec = {"t_send": time.monotonic(), "t_first": None, "t_last": None, "tokens": 0, "max_gap": 0.0, "gaps": [],
                   "error": None}
            try:
                async with http.stream("POST", path, json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data:") or "[DONE]" in line:
                            continue
                        n = _tokens(cfg["route"], json.loads(line[5:]))
                        if not n:
                            continue
                        now = time.monotonic()
                        if rec["t_last"] is not None:
                            rec["max_gap"] = max(rec["max_gap"], now - rec["t_last"])
                            if now - rec["t_last"] > 0.1:
                                rec["gaps"].append((rec["t_last"], now))
                        rec["t_first"] = rec["t_first"] or now
                        rec["t_last"] = now
                        rec["tokens"] += n
                        seen[0] += 1
                        if cfg.get("signal_after") and seen[0] >= cfg["signal_after"] and not signalled[0]:
                            signalled[0] = True
                            print("flowing", flush=True)
            except Exception as exc:
                rec["error"] = repr(exc)
            return rec

    async with httpx.AsyncClient(base_url=cfg["url"], timeout=900,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)) as http:
        return list(await asyncio.gather(*(one(http, i, r) for i, r in enumerate(cfg["requests"]))))


def _body(cfg: dict, i: int, req: dict) -> tuple[str, dict]:
    route, n = cfg["route"], req["max_new_tokens"]
    if route == "chat":
        return "/v1/chat/completions", {"model": cfg["model"], "messages": req["messages"], "max_tokens": n, "temperature": 1.0,
                                        "ignore_eos": True, "stream": True, "seed": cfg["seed"] + i}
    sampling = {"max_tokens": n, "temperature": 1.0, "ignore_eos": True, "seed": cfg["seed"] + i, "logprobs": 0}
    if route == "generate":
        return "/inference/v1/generate", {"token_ids": req["prompt_ids"], "sampling_params": sampling, "stream": True,
                                          "output_mode": "text"}
    return "/v1/completions", {"model": cfg["model"], "prompt": req["prompt_ids"], "stream": True, "return_token_ids": True, **sampling}


def _tokens(route: str, event: dict) -> int:
    choices = event.get("choices") or []
    if route == "chat":  # one token per content chunk (the gateway streams a chunk per engine delta)
        return sum(1 for c in choices if (c.get("delta") or {}).get("content"))
    return sum(len(c.get("token_ids") or []) for c in choices)


class Load:
    """The load process: `await Load(cfg).run()` -> its records (with `on_flowing` called once
    tokens flow, when `cfg["signal_after"]` is set)."""

    def __init__(self, cfg: dict, workdir: Path):
        self.path = workdir / f"load-{time.monotonic_ns()}.json"
        self.path.write_text(json.dumps(cfg))

    async def run(self, on_flowing=None) -> list[dict]:
        proc = await asyncio.create_subprocess_exec(sys.executable, __file__, str(self.path),
                                                    stdout=asyncio.subprocess.PIPE, limit=1 << 26)
        while line := await proc.stdout.readline():
            if line.strip() == b"flowing" and on_flowing is not None:
                await on_flowing()
            elif line.startswith(b"["):
                records = json.loads(line)
        if await proc.wait() != 0:
            raise RuntimeError(f"load process failed ({proc.returncode})")
        return records


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run_load(json.loads(Path(sys.argv[1]).read_text())))), flush=True)
