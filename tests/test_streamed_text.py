"""Held-back streaming text (`flywheel.serve.streamed_text`) against the rule it implements: at every
chunk the client has seen exactly the longest prefix of the answer so far that cannot be (the
start of) a tool call."""

from __future__ import annotations

import random

import pytest

from flywheel.formats.tool_calls import FORMATS
from flywheel.serve.streamed_text import StreamedText


def reference(fmt, text: str) -> str:
    """The rule, written out on the whole text."""
    if fmt.name == "llama3_json":
        stripped = text.lstrip()
        tag = fmt.PYTHON_TAG
        return "" if not stripped or stripped.startswith("{") or tag.startswith(stripped[:len(tag)]) else text
    cut = text.find(fmt.start)
    if cut >= 0:
        return text[:cut]
    for k in range(min(len(fmt.start) - 1, len(text)), 0, -1):
        if text.endswith(fmt.start[:k]):
            return text[:-k]
    return text


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_shown_text_is_the_longest_safe_prefix_at_every_chunk(name):
    fmt = FORMATS[name]
    rng = random.Random(name)
    words = ["Sure", " ", "\n", "{", "}", "<", "tool", "_call", ">", "[TOOL", "_CALLS]", "<|python", "_tag|>", "ok.", "  "]
    for trial in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
        if trial % 3 == 0:
            at = rng.randint(0, len(text))
            text = text[:at] + fmt.start + text[at:]
        forced = fmt.shared if trial % 17 == 0 else ""
        streamed = StreamedText(fmt, forced)
        at = 0
        while at < len(text):
            step = rng.randint(1, 6)
            streamed.add(text[at:at + step])
            at += step
            expected = reference(fmt, forced + text[:at])
            assert streamed.shown == expected and streamed.length == len(expected), (text, at)


def test_nothing_is_examined_once_a_call_has_begun():
    streamed = StreamedText(FORMATS["hermes"])
    assert streamed.add("Let me check. <tool") == "Let me check. "
    assert streamed.add("_call>{") == ""
    for _ in range(1000):
        streamed.add('"x": 1, ')
    assert streamed._pending == '<tool_call>{'  # held text stopped growing when the call began
    assert streamed.shown == "Let me check. "


def test_without_tools_everything_is_shown_as_it_comes():
    streamed = StreamedText(None)
    assert [streamed.add(t) for t in ("<tool_call>", "{", "")] == ["<tool_call>", "{", ""]
    assert streamed.shown == "<tool_call>{" and streamed.length == 12
