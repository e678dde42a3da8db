"""How a model family writes tool calls, and everything done with that format: the gateway
parses calls out of an answer, holds back streamed text that may be a call, forces a call
(`tool_choice`) and constrains a forced call with a grammar; the promotion gate counts answers
that began a call nobody can read (`malformed`).

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen; the
                  format of the prompt the gateway writes for templates that render no tools)
    llama3_json   {"name": "f", "parameters": {...}}     the whole answer, optionally after
                  <|python_tag|>; several calls separated by "; "   (Llama 3.1+ JSON tool calling)
    mistral       [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]   (Mistral)

`detect` picks the format from the chat template (`serve.tool_format: auto`); config can name it.

A forced call: the prompt ends with the call's opening (`opening(name)`: for a named function
up to its arguments, else the part every call shares), and the rest is decoded under a Lark
grammar (SGLang's `ebnf` parameter, llguidance's dialect): the function's name where any may be
called, arguments matching its JSON schema (spaced as `json.dumps` writes them), the closing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""How constrained JSON is spaced: as `json.dumps` writes it, the way templates show calls."""
_DECODER = json.JSONDecoder()


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _call(body: Any, arguments_key: str) -> dict[str, Any] | None:
    """A call from a parsed JSON object with a string `name`, else None."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    return new_call(body["name"], body.get(arguments_key, body.get("arguments", {})))


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    """Text that begins the calls: from here on, streamed text is held back."""
    close: str
    """Text that ends one call (after its arguments)."""
    shared: str
    """The opening every call of one answer shares (what a `required` call is forced with)."""
    arguments_key: str = "arguments"
    single_call_stop: str | None = None
    """A stop string that ends the answer after its first call (`parallel_tool_calls: false`);
    None where the format's calls end the answer anyway."""

    def opening(self, function: str) -> str:
        """The text of a call up to its arguments."""
        return f'{self.shared}{{"name": {json.dumps(function)}, "{self.arguments_key}":'

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of an answer; no calls means the text is all content."""
        raise NotImplementedError

    def malformed(self, text: str) -> bool:
        """Whether an answer began a call (`start` is in it) that `parse` cannot read."""
        return self.start in text and not self.parse(text)[1]

    def release(self, pending: str, shown: bool) -> tuple[int, bool]:
        """How much of `pending` (streamed text not yet shown; `shown`: whether any text before it
        was) cannot be (the start of) a call and may be shown now, and whether the rest is a
        call for good (nothing more will be shown). Shown text never ends with the beginning of
        `start`, so a call cannot begin before `pending` does."""
        cut = pending.find(self.start)
        if cut >= 0:
            return cut, True
        for k in range(min(len(self.start) - 1, len(pending)), 0, -1):
            if pending.endswith(self.start[:k]):
                return len(pending) - k, False
        return len(pending), False

    def forced_prefix(self, tool_choice: Any) -> str:
        """Text the prompt ends with to force a call ("" when the model may choose)."""
        name = getattr(tool_choice, "name", None)
        if name:
            return self.opening(name)  # no trailing space: a token boundary
        return self.shared if tool_choice == "required" else ""

    def forced_grammar(self, tool_choice: Any, tools: list[dict[str, Any]]) -> str | None:
        """The Lark grammar of what follows `forced_prefix(tool_choice)` (None when nothing is forced)."""
        functions = {t["function"]["name"]: t["function"] for t in tools}
        name = getattr(tool_choice, "name", None)
        if name:
            return f'start: " " {_json(functions[name])} {json.dumps(self.close)}'
        if tool_choice != "required":
            return None
        calls = [f"{json.dumps(self.opening(n)[len(self.shared):] + ' ')} {_json(f)} {json.dumps(self.close)}"
                 for n, f in functions.items()]
        return "start: " + " | ".join(calls)

    def truncated_call(self, forced: str, text: str) -> dict[str, Any] | None:
        """The call a forced answer cut short by `max_tokens` stands for: the name when it is
        whole, the arguments written so far: the whole JSON value when it was finished (the cut
        came in the call's closing), else the prefix the grammar let through."""
        body = forced + text
        match = re.search(r'"name": "([^"]*)", "' + self.arguments_key + '": ?', body)
        if match is None:
            return None
        arguments = body[match.end():]
        try:
            _, end = _DECODER.raw_decode(arguments)
        except json.JSONDecodeError:
            return new_call(match.group(1), arguments)
        return new_call(match.group(1), arguments[:end])


def _json(function: dict[str, Any]) -> str:
    schema = dict(function.get("parameters") or {"type": "object"})
    schema["x-guidance"] = JSON_STYLE
    return f"%json {json.dumps(schema)}"


class Hermes(ToolFormat):
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        position = 0
        for match in re.finditer(re.escape(self.start) + r"(.*?)" + re.escape(self.end_tag), text, re.DOTALL):
            try:
                call = _call(json.loads(match.group(1)), self.arguments_key)
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            kept.append(text[position:match.start()])
            position = match.end()
            calls.append(call)
        kept.append(text[position:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls

    @property
    def end_tag(self) -> str:
        return self.close[1:]  # the closing after a call's JSON object: "}" then the tag


class Llama3Json(ToolFormat):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(value, self.arguments_key)
            if call is None:
                return text, []
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return text, []
            position = len(body) - len(rest[1:].lstrip())
        return None, calls

    def malformed(self, text: str) -> bool:
        """An answer that is calls begins with one: only then can it be a call gone wrong."""
        return text.strip().startswith(("{", self.PYTHON_TAG)) and not self.parse(text)[1]

    def release(self, pending: str, shown: bool) -> tuple[int, bool]:
        if shown:
            return len(pending), False  # the answer began with text: it is not calls
        stripped = pending.lstrip()
        if not stripped or self.PYTHON_TAG.startswith(stripped[:len(self.PYTHON_TAG)]) and len(stripped) < len(self.PYTHON_TAG):
            return 0, False  # maybe the start of a call
        if stripped.startswith(("{", self.PYTHON_TAG)):
            return 0, True  # an answer that is calls is nothing but calls
        return len(pending), False


class Mistral(ToolFormat):
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            value = json.loads(text[at + len(self.start):])
        except json.JSONDecodeError:
            return text, []
        calls = [_call(item, self.arguments_key) for item in (value if isinstance(value, list) else [value])]
        if not calls or any(call is None for call in calls):
            return text, []
        return text[:at].strip() or None, calls  # type: ignore[return-value]


HERMES = Hermes("hermes", start="<tool_call>", close="}</tool_call>", shared="<tool_call>", single_call_stop="</tool_call>")
FORMATS: dict[str, ToolFormat] = {
    "hermes": HERMES,
    "llama3_json": Llama3Json("llama3_json", start="{", close="}", shared="", arguments_key="parameters"),
    "mistral": Mistral("mistral", start="[TOOL_CALLS]", close="}]", shared="[TOOL_CALLS] ["),
}


def detect(template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches (Hermes when it names none we know)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or '"parameters": dictionary' in template or "Environment: ipython" in template:
        return FORMATS["llama3_json"]
    return HERMES
