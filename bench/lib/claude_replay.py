"""Replaying a recorded Claude Code request sequence through Flywheel's gateway:
`bench/agent_clis.py --replay` uses it on `bench/data/claude_code_subagent.json`, the
requests Claude Code sent to the scripted model of `bench/lib/scripted_anthropic.py` in a run that
started a sub-agent.

Each recorded `POST /v1/messages` body is sent as it was (only `model` is set to the served
model's name where the recording's differs), in the order Claude Code sent them, one after
another, with the recorded headers that matter (`x-claude-code-session-id`, `anthropic-beta`,
`anthropic-version`, `user-agent`, `x-app`). Two ways for the served model to answer:

- `free`: it samples, as it would for Claude Code. The replayed histories hold the scripted
  answers, not these, so nothing later in the sequence continues what the model answered.
- `steered`: each answer is the one the script gave at that point, drawn by the served model
  under a regular expression that allows exactly that text (the engine's constrained decoding; a
  tool call in the model's tool format, so the gateway parses it back into the same `tool_use`).
  The replayed histories are then what Claude Code would have sent had Flywheel's model answered
  as the script did (the `tool_use` ids excepted: the gateway gives its own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURE = DATA / "claude_code_subagent.json"
"""Claude Code 2.1.197 (the version of the live runs); `claude_code_subagent_<version>.json` are
other versions' runs of the same task."""
REPLAYED_HEADERS = ("anthropic-beta", "anthropic-version", "user-agent", "x-app", "x-claude-code-session-id", "content-type")


def literal_regex(text: str) -> str:
    """A regular expression (Rust syntax, as llguidance reads it) matching exactly `text`."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def steered_text(answer: dict[str, Any]) -> str:
    """The text the served model writes for a scripted Anthropic Message (one text or tool_use
    block): the text itself, or the call in the Hermes format the `tiny` and SmolLM2 prompts use
    (`serve/tools`), its arguments serialised as the Messages translation serialises them."""
    block = answer["content"][0]
    if block["type"] == "text":
        return block["text"]
    return f'<tool_call>{{"name": {json.dumps(block["name"])}, "arguments": {json.dumps(block["input"])}}}</tool_call>'


class Steered:
    """An engine client (`flywheel.serve.backends`) that constrains the next request's output to a given
    text and passes everything else to `inner`. One request at a time: `expect(text)` before it."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.pending: str | None = None

    def expect(self, text: str) -> None:
        self.pending = text

    def _steer(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.pending is None:
            raise RuntimeError("a request reached the steered engine with no answer expected")
        sampling = {**body["sampling_params"], "regex": literal_regex(self.pending)}
        self.pending = None
        return {**body, "sampling_params": sampling}

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.inner.generate(self._steer(body))

    def generate_stream(self, body: dict[str, Any]):
        return self.inner.generate_stream(self._steer(body))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def fixtures() -> list[Path]:
    """Every recorded sub-agent run in bench/data."""
    return sorted(DATA.glob("claude_code_subagent*.json"))


def message_requests(fixture: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded Messages requests in the order Claude Code sent them."""
    return sorted((r for r in fixture["requests"] if r.get("path", "").startswith("/v1/messages")), key=lambda r: r["index"])


async def read_answer(response: httpx.Response) -> dict[str, Any]:
    """What a (streamed or whole) Messages answer said: its blocks, stop reason and error, if any."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        body = json.loads(await response.aread())
        return {"content": body.get("content"), "stop_reason": body.get("stop_reason"), "error": body.get("error")}
    blocks: list[dict[str, Any]] = []
    out: dict[str, Any] = {"content": blocks, "stop_reason": None, "error": None}
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        event = json.loads(line[5:])
        kind = event.get("type")
        if kind == "content_block_start":
            blocks.append({**event["content_block"], "partial": ""})
        elif kind == "content_block_delta":
            delta = event["delta"]
            blocks[-1]["partial"] += delta.get("text", delta.get("partial_json", ""))
        elif kind == "message_delta":
            out["stop_reason"] = event["delta"].get("stop_reason")
        elif kind == "error":
            out["error"] = event.get("error")
    return out


async def replay(url: str, model: str, fixture: dict[str, Any], steered: Steered | None, timeout_s: float = 600) -> list[dict[str, Any]]:
    """Send the fixture's Messages requests to the gateway at `url`; returns, per request, its
    index and role in the recording, the status, the interaction id the gateway recorded its
    answer under, and the answer (abridged)."""
    sent = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        for record in message_requests(fixture):
            body = {**record["body"], "model": model}
            headers = {k: v for k, v in record["headers"].items() if k in REPLAYED_HEADERS} | {"x-api-key": "unused"}
            if steered is not None:
                steered.expect(steered_text(record["answer"]))
            async with http.stream("POST", record["path"], json=body, headers=headers) as response:
                answer = await read_answer(response)
            sent.append({"index": record["index"], "role": record["role"], "status": response.status_code,
                         "interaction_id": response.headers.get("x-interaction-id"),
                         "answer": [_abridged(block) for block in answer["content"] or []],
                         "stop_reason": answer["stop_reason"], "error": answer["error"]})
    return sent


def _abridged(block: dict[str, Any]) -> str:
    if block.get("type") == "tool_use":
        return f"tool_use {block.get('name')} {block.get('partial', '')[:80]}"
    return f"{block.get('type')} {(block.get('partial') or block.get('text') or '')[:80]!r}"
