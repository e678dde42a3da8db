"""A scripted Anthropic Messages server that drives Claude Code into starting a sub-agent, and
records every request it gets: `bench/agent_clis.py --record-subagent`
runs `claude -p` against it and saves what it recorded as the fixture its `--replay` mode sends
through Flywheel (`bench/data/claude_code_subagent.json`).

Why a script: the models Flywheel serves here (`tiny`, SmolLM2-135M) never call Claude Code's
sub-agent tool, so the request sequence of a run that starts one can only be obtained from a
model that is told what to answer. The script answers by what a request is, never by its place in
the sequence (Claude Code sends some requests concurrently):

- the main agent (its messages hold the user's prompt, not the sub-agent's): first a `tool_use`
  of the sub-agent tool (`Agent`, or `Task` in older versions: whichever the request's `tools`
  offer) with SUBAGENT_PROMPT; then a final text (first a short one where the tool result says
  the sub-agent was launched in the background, as newer versions do);
- the sub-agent (a user message holds SUBAGENT_PROMPT): one `Bash` call (`ls`), then a text;
- anything else (titles, summaries, quota checks): a short text (JSON `{"title": ...}` where the
  request asks for a JSON answer: the title call).

Answers are streamed as Anthropic's named events (message_start ... message_stop), or sent as one
Message when the request is not streamed. `HEAD /` (Claude Code's preflight) gets a 404.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

SUBAGENT_PROMPT = "Run `ls` in the current directory and report the file names you see. (sub-agent task)"
SUBAGENT_TOOLS = ("Agent", "Task")
KEPT_HEADERS = ("anthropic-beta", "anthropic-version", "user-agent", "x-app", "x-claude-code-session-id",
                "x-stainless-retry-count", "x-stainless-timeout", "content-type")
"""The request headers kept in the recording (the rest: auth, connection, stainless platform)."""


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    return [part.get("text", "") for part in content or [] if isinstance(part, dict) and part.get("type") == "text"]


def role_of(body: dict[str, Any], user_prompt: str) -> str:
    """Which conversation a request belongs to: `subagent`, `main` or `helper`."""
    user_texts = [text for m in body.get("messages", []) if m.get("role") == "user" for text in _texts(m)]
    if any(SUBAGENT_PROMPT in text for text in user_texts):
        return "subagent"
    tools = {tool.get("name") for tool in body.get("tools") or []}
    if tools & set(SUBAGENT_TOOLS) and any(text.strip() == user_prompt for text in user_texts):
        return "main"
    return "helper"


def answer_for(body: dict[str, Any], role: str, step: int) -> dict[str, Any]:
    """The scripted answer: {"text": str} or {"tool": name, "input": {...}}; `step` counts the
    assistant messages already in the request's history."""
    tools = {tool.get("name") for tool in body.get("tools") or []}
    if role == "main" and step == 0:
        name = next(n for n in SUBAGENT_TOOLS if n in tools)
        return {"tool": name, "input": {"description": "List the files", "prompt": SUBAGENT_PROMPT,
                                        "subagent_type": "general-purpose"}}
    if role == "main" and "Async agent launched" in json.dumps(body["messages"][-1].get("content")):
        return {"text": "A sub-agent is listing the files."}  # newer versions run it in the background
    if role == "main":
        return {"text": "The sub-agent found two files here: a.txt and b.txt."}
    if role == "subagent" and step == 0 and "Bash" in tools:
        return {"tool": "Bash", "input": {"command": "ls", "description": "List files in the current directory"}}
    if role == "subagent":
        return {"text": "The directory holds a.txt and b.txt."}
    if ((body.get("output_config") or {}).get("format") or {}).get("type") == "json_schema":
        return {"text": json.dumps({"title": "List files with a sub-agent"})}  # the title call asks for {"title": ...}
    return {"text": "Listing files with a sub-agent"}


def message(answer: dict[str, Any], model: str, number: int) -> dict[str, Any]:
    """The answer as an Anthropic Message (ids numbered so the recording is reproducible)."""
    if "tool" in answer:
        block = {"type": "tool_use", "id": f"toolu_scripted_{number:03d}", "name": answer["tool"], "input": answer["input"]}
        stop = "tool_use"
    else:
        block, stop = {"type": "text", "text": answer["text"]}, "end_turn"
    return {"id": f"msg_scripted_{number:03d}", "type": "message", "role": "assistant", "model": model, "content": [block],
            "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def events(whole: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The Message as the named stream events Claude Code reads."""
    block = whole["content"][0]
    start = {**whole, "content": [], "stop_reason": None}
    if block["type"] == "tool_use":
        opened = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    else:
        opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    return [("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": opened}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {"type": "message_stop"})]


class ScriptedAnthropic:
    """`async with ScriptedAnthropic(prompt) as s:` serves on s.url; s.records lists every request
    as {"index", "t_received", "t_answered", "method", "path", "headers", "body", "role", "answer"}."""

    def __init__(self, user_prompt: str):
        self.user_prompt = user_prompt
        self.records: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def messages(request):
            body = await request.json()
            record = {"index": len(self.records), "t_received": round(time.monotonic() - self.t0, 3), "method": "POST",
                      "path": request.url.path + (f"?{request.url.query}" if request.url.query else ""),
                      "headers": {k: v for k, v in request.headers.items() if k in KEPT_HEADERS}, "body": body}
            self.records.append(record)
            record["role"] = role_of(body, self.user_prompt)
            step = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
            record["answer"] = whole = message(answer_for(body, record["role"], step), body.get("model", ""), record["index"])
            record["t_answered"] = round(time.monotonic() - self.t0, 3)
            if not body.get("stream"):
                return JSONResponse(whole)
            stream = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events(whole))
            return StreamingResponse(iter([stream]), media_type="text/event-stream")

        async def other(request):
            self.records.append({"index": len(self.records), "t_received": round(time.monotonic() - self.t0, 3),
                                 "method": request.method, "path": request.url.path, "unanswered": True})
            return Response(status_code=404)

        return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                                 Route("/{path:path}", other, methods=["GET", "HEAD", "POST"])])

    async def __aenter__(self) -> "ScriptedAnthropic":
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        await self._task
