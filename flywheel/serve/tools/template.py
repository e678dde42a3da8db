"""Tools in the prompt: whether the chat template renders them, and the prompt the gateway writes
when it does not.

A chat template that renders `tools` (and assistant `tool_calls`) itself is used as it is; the
model's answer is then read in the format that template teaches (`flywheel.formats.tool_calls`). For one
that does not (SmolLM2's), the gateway adds the tool list to the system message in the Hermes
format the `tiny` template teaches:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

and writes earlier calls into the assistant text, so the model always sees one format.
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.formats.tool_calls import HERMES

_PROBE = "flywheel_probe_tool"


def _probe_renders(tokenizer: Any, **kwargs: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception:
        return False
    return _PROBE in text


def template_support(tokenizer: Any) -> tuple[bool, bool]:
    """(renders `tools`, renders assistant `tool_calls`) for this tokenizer's chat template."""
    user = {"role": "user", "content": "x"}
    tool = {"type": "function", "function": {"name": _PROBE, "parameters": {}}}
    call = {"id": "c", "type": "function", "function": {"name": _PROBE, "arguments": "{}"}}
    return (
        _probe_renders(tokenizer, conversation=[user], tools=[tool]),
        _probe_renders(tokenizer, conversation=[user, {"role": "assistant", "content": "", "tool_calls": [call]}, user]),
    )


def tools_block(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t) for t in tools)
    return (
        f"# Tools\nYou may call these tools:\n<tools>\n{listing}\n</tools>\n"
        f'To call one, reply with {HERMES.start}{{"name": <name>, "arguments": <args>}}{HERMES.end_tag}'
    )


def call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    return f'{HERMES.opening(function["name"])} {function["arguments"]}{HERMES.close}'


def adapt_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   renders_tools: bool, renders_calls: bool) -> list[dict[str, Any]]:
    """Messages a template without tool support can render in the documented format."""
    out = [dict(m) for m in messages]
    if not renders_calls:
        for message in out:
            calls = message.pop("tool_calls", None)
            if calls:
                text = "\n".join(call_text(c) for c in calls)
                message["content"] = f"{message['content']}\n{text}" if message.get("content") else text
    if tools and not renders_tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
