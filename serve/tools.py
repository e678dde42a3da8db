"""Tools: rendering them into the prompt, forcing a call, and parsing calls out of the output.

The tool-call format (Hermes/Qwen style, what the `tiny` template teaches):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call, anywhere in the assistant's text. Text outside the blocks is the message
`content`. A block whose body is not a JSON object with a string `name` is left in the content.

Prompts: a chat template that renders `tools` (and assistant `tool_calls`) itself is used as it
is. For one that does not (SmolLM2's), the gateway adds the tool list to the system message in
the same wording the `tiny` template uses and writes earlier calls into the assistant text, so
the model always sees one format. `tool_choice: "required"` or a named function is enforced by
ending the prompt with the opening of a call, which the model then completes; those forced
tokens belong to the prompt (loss mask 0), the rest is sampled under a grammar
(`forced_grammar`, SGLang's `ebnf` parameter in llguidance's Lark dialect): the function's name
when any may be called, arguments that match its JSON schema, the closing tag, then the end of
the answer. A forced call therefore always parses, unless `max_tokens` cuts it short (then, as
OpenAI does, it comes back as a call with truncated arguments and finish reason `length`).
With a real SGLang engine this needs `--grammar-backend llguidance`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
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
        f'To call one, reply with {OPEN}{{"name": <name>, "arguments": <args>}}{CLOSE}'
    )


def call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    return f'{OPEN}{{"name": {json.dumps(function["name"])}, "arguments": {function["arguments"]}}}{CLOSE}'


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


def forced_prefix(tool_choice: Any) -> str:
    """Text the prompt ends with to force a tool call ("" when the model may choose)."""
    if tool_choice == "required":
        return OPEN
    name = getattr(tool_choice, "name", None)
    if name:
        return f'{OPEN}{{"name": {json.dumps(name)}, "arguments":'  # no trailing space: a token boundary
    return ""


JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""How constrained arguments are spaced: as `json.dumps` writes them, the way the template shows calls."""


def _arguments_grammar(function: dict[str, Any]) -> str:
    schema = dict(function.get("parameters") or {"type": "object"})
    schema["x-guidance"] = JSON_STYLE
    return f"%json {json.dumps(schema)}"


def forced_grammar(tool_choice: Any, tools: list[dict[str, Any]]) -> str | None:
    """The Lark grammar of what follows `forced_prefix(tool_choice)` (None when nothing is forced)."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    name = getattr(tool_choice, "name", None)
    if name:
        return f"start: \" \" {_arguments_grammar(functions[name])} {json.dumps('}' + CLOSE)}"
    if tool_choice != "required":
        return None
    calls = [f"{json.dumps('{' + json.dumps('name') + ': ' + json.dumps(n) + ', ' + json.dumps('arguments') + ': ')} "
             f"{_arguments_grammar(f)} {json.dumps('}' + CLOSE)}" for n, f in functions.items()]
    return "start: " + " | ".join(calls)


_FORCED_NAME = re.compile(r'^\{"name": "([^"]*)"')


def truncated_call(forced: str, text: str) -> dict[str, Any] | None:
    """The call a forced answer cut short by `max_tokens` stands for: the name when it is whole,
    the arguments written so far."""
    body = (forced + text)[len(OPEN):]
    match = _FORCED_NAME.match(body)
    if match is None:
        return None
    arguments = body.split('"arguments": ', 1)[1] if '"arguments": ' in body else ""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": match.group(1), "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an assistant output in the documented format."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
            valid = isinstance(body, dict) and isinstance(body.get("name"), str)
        except json.JSONDecodeError:
            valid = False
        if not valid:
            continue
        kept.append(text[position:match.start()])
        position = match.end()
        arguments = body.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": body["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
