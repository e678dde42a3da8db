"""Multi-turn conversations in which real clients send their own response messages back.

An agent's second turn carries the assistant message its client library returned for the first:
the openai SDK's `ChatCompletionMessage` (with `refusal`, `annotations`, `audio`,
`function_call`), LangChain's `AIMessage`, litellm's `Message` (with `provider_specific_fields`
and reasoning fields). Keys a client adds inside messages, content parts and tool calls are
accepted and ignored: the prompt is exactly the one the plain message gives. Unknown top-level
parameters, and content parts the model cannot take, stay 400s naming the field.
"""

import functools
import operator

import httpx
import openai
import pytest
from openai.types.chat import (
    ChatCompletionAudio,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
)
from openai.types.chat.chat_completion_message import (
    Annotation,
    AnnotationURLCitation,
    FunctionCall,
)

from bus_reading import traffic_records

ASK = {"role": "user", "content": "Write some digits."}
AGAIN = {"role": "user", "content": "And again."}
GREEDY = dict(model="tiny", max_tokens=4, temperature=0)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sync:
        yield sync


def same_prompt(client, history: list, plain: list, **extra) -> None:
    """`history` (with a client's message objects) is served exactly like `plain`."""
    sent = client.chat.completions.create(messages=history, **GREEDY, **extra)
    expected = client.chat.completions.create(messages=plain, **GREEDY, **extra)
    assert sent.usage.prompt_tokens == expected.usage.prompt_tokens
    assert sent.choices[0].message.content == expected.choices[0].message.content


def test_openai_sdk_response_messages_go_back_into_the_history(client):
    first = client.chat.completions.create(messages=[ASK], **GREEDY).choices[0].message
    dumped = first.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    plain = [ASK, {"role": "assistant", "content": first.content}, AGAIN]
    same_prompt(client, [ASK, dumped, AGAIN], plain)
    same_prompt(client, [ASK, first.model_dump(exclude_none=True), AGAIN], plain)
    # The same message type with its optional fields set, as other servers return them.
    rich = ChatCompletionMessage(
        role="assistant", content=first.content, refusal=None,
        function_call=FunctionCall(name="lookup", arguments="{}"),
        annotations=[Annotation(type="url_citation", url_citation=AnnotationURLCitation(
            start_index=0, end_index=1, title="t", url="https://example.com"))],
        audio=ChatCompletionAudio(id="audio_1", data="", expires_at=0, transcript=""),
    )
    same_prompt(client, [ASK, rich.model_dump(), AGAIN], plain)


async def test_the_recorded_turn_keeps_only_what_the_prompt_used(served, bus):
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client:
        first = (await client.chat.completions.create(messages=[ASK], **GREEDY)).choices[0].message
        await client.chat.completions.create(messages=[ASK, first.model_dump(), AGAIN], **GREEDY)
    _, second = await traffic_records(bus, 2)
    assert second.messages == [ASK, {"role": "assistant", "content": first.content}, AGAIN]


def test_openai_sdk_tool_call_messages_go_back_into_the_history(client):
    call = ChatCompletionMessageFunctionToolCall(
        id="call_1", type="function", function={"name": "get_weather", "arguments": '{"city": "Paris"}'})
    asked = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call])
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    plain_call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    plain = [ASK, {"role": "assistant", "content": None, "tool_calls": [plain_call]}, result]
    same_prompt(client, [ASK, asked.model_dump(), result], plain, tools=[WEATHER])
    # Keys some clients add inside a tool call (a streamed call's `index`, Gemini's `extra_content`).
    extended = {**plain_call, "index": 0, "extra_content": {"google": {"thought_signature": "x"}},
                "function": {**plain_call["function"], "parsed": None}}
    same_prompt(client, [ASK, {"role": "assistant", "content": None, "tool_calls": [extended]}, result], plain,
                tools=[WEATHER])


def test_langchain_two_turn_conversations(gateway):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.messages.content import create_text_block
    from langchain_openai import ChatOpenAI

    ask, again = HumanMessage(ASK["content"]), HumanMessage(AGAIN["content"])

    def check(chat, history: list, reply: AIMessage) -> None:
        second = chat.invoke(history)
        plain = chat.invoke([ask, AIMessage(reply.text), again])
        assert second.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"]
        assert second.text == plain.text

    for version in ("v0", "v1"):  # v1: replies as lists of LangChain's standard content blocks
        chat = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="x", model="tiny", max_tokens=4, temperature=0,
                          max_retries=0, output_version=version)
        first = chat.invoke([ask])
        assert isinstance(first, AIMessage)
        check(chat, [ask, first, again], first)
        streamed = functools.reduce(operator.add, chat.stream([ask]))
        check(chat, [ask, streamed, again], streamed)
    # Messages written with LangChain 1's standard content blocks: each text block carries its
    # own `id` onto the wire.
    ask_blocks = HumanMessage(content_blocks=[create_text_block(ASK["content"])])
    assert "id" in ask_blocks.content[0]
    first = chat.invoke([ask_blocks])
    check(chat, [ask_blocks, first, HumanMessage(content_blocks=[create_text_block(AGAIN["content"])])], first)


def test_litellm_messages_go_back_into_the_history(client):
    """litellm cannot be installed next to this project's packages: litellm 1.106.2 (the newest
    that resolves here) pins openai<3, huggingface-hub<2 and filelock<4 and would downgrade the
    installed ones. Its messages are therefore written out here as litellm 1.106.2 produces them
    for this gateway's replies (captured with it in a separate environment):
    `litellm.completion(model="openai/tiny", api_base=...)` returns a `litellm.types.utils.Message`
    whose `model_dump()` is `wire` plus `tool_calls: None, function_call: None`, and sends `wire`
    when that message (object or dump) goes back into `messages`; the OpenAI SDK's `refusal` is
    moved into `provider_specific_fields`. Reasoning providers add `reasoning_content` and
    `thinking_blocks` (fields of the same class)."""
    first = client.chat.completions.create(messages=[ASK], **GREEDY).choices[0].message
    plain = [ASK, {"role": "assistant", "content": first.content}, AGAIN]
    wire = {"content": first.content, "role": "assistant", "provider_specific_fields": {"refusal": None}}
    dumped = {**wire, "tool_calls": None, "function_call": None}
    reasoning = {**dumped, "reasoning_content": "think",
                 "thinking_blocks": [{"type": "thinking", "thinking": "think", "signature": "sig"}]}
    for message in (wire, dumped, reasoning):
        same_prompt(client, [ASK, message, AGAIN], plain)


def test_text_parts_may_carry_extra_keys(client):
    parts = [{"type": "text", "text": ASK["content"], "cache_control": {"type": "ephemeral"}}]
    same_prompt(client, [{"role": "user", "content": parts}], [ASK])


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [ASK], "frobnicate": 1}, "frobnicate", "unsupported parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages.0.content.0.type", "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]},
     "messages.0.content.1.type", "input_audio"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "required"),
])
def test_what_stays_a_400_names_its_field(gateway, body, param, words):
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
