"""Drives a Flywheel endpoint with litellm, unmodified but for base URL and key (run by the
interpreter of `.venv-msa`, where litellm lives: it pins `openai<3`). Prints one JSON object:
what each call returned. Usage: python litellm_calls.py URL MODEL"""

import asyncio
import json
import sys

import litellm

URL, MODEL = sys.argv[1], sys.argv[2]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}  # closed: any other key would let untrained tiny write past max_tokens
OPENAI = {"model": f"openai/{MODEL}", "api_base": f"{URL}/v1", "api_key": "unused", "max_tokens": 6}


def session(name: str) -> dict:
    return {"extra_headers": {"X-Session-Id": f"litellm-{name}"}}


async def main() -> dict:
    out = {}
    reply = litellm.completion(messages=ASK, **OPENAI, **session("chat"))
    out["chat"] = {"content": reply.choices[0].message.content, "finish_reason": reply.choices[0].finish_reason,
                   "completion_tokens": reply.usage.completion_tokens}
    chunks = [chunk.choices[0].delta.content or "" for chunk in litellm.completion(messages=ASK, stream=True, **OPENAI, **session("stream"))]
    out["stream"] = {"content": "".join(chunks), "chunks": len(chunks)}
    reply = await litellm.acompletion(messages=ASK, **OPENAI, **session("async"))
    out["async"] = {"content": reply.choices[0].message.content}
    reply = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", **{**OPENAI, "max_tokens": 40},
                               **session("tools"))
    calls = reply.choices[0].message.tool_calls or []
    out["tools"] = {"calls": [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls],
                    "finish_reason": reply.choices[0].finish_reason}
    reply = litellm.completion(model=f"anthropic/{MODEL}", api_base=URL, api_key="unused", messages=ASK, max_tokens=6,
                               **session("messages"))
    out["messages"] = {"content": reply.choices[0].message.content, "finish_reason": reply.choices[0].finish_reason}
    reply = litellm.responses(model=f"openai/{MODEL}", api_base=f"{URL}/v1", api_key="unused", input="Hello",
                              max_output_tokens=6, **session("responses"))
    out["responses"] = {"status": reply.status, "text": reply.output[0].content[0].text}
    return out


print(json.dumps(asyncio.run(main())))
