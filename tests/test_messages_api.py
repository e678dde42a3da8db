"""Anthropic's Messages API (`/v1/messages`) with the official anthropic client, and Claude Code's
request shape: answers and streams match the recorded turns, tool use goes both ways, sessions
come from Claude Code's own ids, errors and auth take Anthropic's shape."""

import json

import anthropic
import httpx
import pytest

from bus_reading import recorded_turns
from factories import ASK_WEATHER, WEATHER, serving

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"], "input_schema": WEATHER["function"]["parameters"]}
"""The weather tool in Anthropic's shape."""


@pytest.fixture
def client(served):
    return anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)


@pytest.fixture
async def served_tools(tool_model, nats_url, tmp_path):
    async with serving(tool_model, "tool-tiny", nats_url, tmp_path, "serve.api_keys=[secret]") as loop:
        yield loop, anthropic.AsyncAnthropic(base_url=loop.url, api_key="secret", max_retries=0)


async def test_an_answer_is_the_recorded_turn(served, client, bus):
    message = await client.messages.create(model="tiny", max_tokens=8, system="Be brief.",
                                           messages=[{"role": "user", "content": "Write some digits."}])
    [turn] = await recorded_turns(bus, 1)
    assert turn.endpoint == "messages"
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write some digits."}]
    text = served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
    assert "".join(block.text for block in message.content) == text
    assert message.stop_reason == ("max_tokens" if turn.finish_reason == "length" else "end_turn")
    assert message.usage.output_tokens == len(turn.output_ids) and message.usage.input_tokens == len(turn.prompt_ids)


async def test_a_stream_is_anthropics_event_sequence(served, client, bus):
    async with client.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0.7},
                                      messages=[{"role": "user", "content": "Write some digits."}]) as stream:
        names = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.index("content_block_start") < names.index("content_block_stop") < names.index("message_delta")
    [turn] = await recorded_turns(bus, 1)
    assert final.content[0].text == served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
    assert final.usage.output_tokens == len(turn.output_ids)


async def test_stop_sequences_name_the_one_that_matched(served, client):
    ask = dict(model="tiny", max_tokens=30, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Write some digits."}])
    free = (await client.messages.create(**ask)).content[0].text  # greedy: the same text again below, up to the stop
    assert len(free) >= 8
    stop = free[4:8]
    message = await client.messages.create(**ask, stop_sequences=["~never~", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(block.text for block in message.content) == free[:free.index(stop)]


async def test_tool_use_goes_out_and_results_come_back_in_one_session(served_tools, bus):
    _, client = served_tools
    headers = {"x-claude-code-session-id": "claude-1"}
    first = await client.messages.create(model="tool-tiny", max_tokens=40, extra_body={"temperature": 0}, tools=[TOOL], messages=ASK_WEATHER,
                                         extra_headers=headers)
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    history = [*ASK_WEATHER, {"role": "assistant", "content": [use.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    async with client.messages.stream(model="tool-tiny", max_tokens=8, extra_body={"temperature": 0}, tools=[TOOL], messages=history,
                                      extra_headers=headers) as stream:
        await stream.get_final_message()
    one, two = await recorded_turns(bus, 2)
    assert one.session_id == two.session_id == f"{one.tenant}/claude-1"  # the key's tenant's session
    assert two.messages[1]["tool_calls"][0]["id"] == use.id
    assert two.messages[2] == {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}
    assert two.prompt_ids[:len(one.prompt_ids)] == one.prompt_ids


async def test_a_streamed_tool_use_is_a_whole_block(served_tools):
    _, client = served_tools
    async with client.messages.stream(model="tool-tiny", max_tokens=40, extra_body={"temperature": 0}, tools=[TOOL], messages=ASK_WEATHER) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


CLAUDE_CODE_BODY = {
    "model": "tool-tiny", "max_tokens": 32000,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
               {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>today</system-reminder>"},
                                     {"type": "text", "text": "list the files here", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types: general."},
    ],
    "tools": [{"name": "Bash", "description": "Runs a command",
               "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                                "properties": {"command": {"type": "string"}}, "required": ["command"],
                                "additionalProperties": False}}],
    "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "from-metadata"})},
    "thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
CLAUDE_CODE_HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                       "x-app": "cli", "x-api-key": "secret"}


async def test_claude_code_requests_streamed_and_not(served_tools, bus):
    loop, _ = served_tools
    async with httpx.AsyncClient(base_url=loop.url, timeout=60) as http:
        assert (await http.head("/")).status_code == 200
        async with http.stream("POST", "/v1/messages?beta=true", json={**CLAUDE_CODE_BODY, "stream": True},
                               headers={**CLAUDE_CODE_HEADERS, "x-claude-code-session-id": "cc-1"}) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        fallback = await http.post("/v1/messages?beta=true", json=CLAUDE_CODE_BODY, headers=CLAUDE_CODE_HEADERS)
        counted = await http.post("/v1/messages/count_tokens?beta=true", headers=CLAUDE_CODE_HEADERS,
                                  json={k: v for k, v in CLAUDE_CODE_BODY.items() if k != "max_tokens"})
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[0] == "message_start" and names[-1] == "message_stop"
    assert fallback.status_code == 200 and fallback.json()["type"] == "message"
    streamed, whole = await recorded_turns(bus, 2)
    assert (streamed.session_id, whole.session_id) == (f"{streamed.tenant}/cc-1", f"{whole.tenant}/from-metadata")
    # A system message partway through stays where it stands: the history is append-only, so a
    # later request of the conversation still continues this one (merged into the first system
    # message, it split Claude Code's sub-agents into two conversations).
    assert whole.messages[0] == {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.197;\n"
                                                              "You are a Claude agent."}
    assert whole.messages[2] == {"role": "system", "content": "Available agent types: general."}
    assert [m["role"] for m in whole.messages] == ["system", "user", "system"]
    assert counted.json() == {"input_tokens": len(whole.prompt_ids)}


async def test_errors_and_auth_take_anthropics_shape(served_tools):
    loop, client = served_tools
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="tool-tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="other", max_tokens=4, messages=ASK_WEATHER)
    wrong = anthropic.AsyncAnthropic(base_url=loop.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await wrong.messages.create(model="tool-tiny", max_tokens=4, messages=ASK_WEATHER)
    assert denied.value.body["error"]["type"] == "authentication_error"
    async with httpx.AsyncClient(base_url=loop.url, timeout=30) as http:
        for change in ({"top_k": 5}, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, {"max_tokens": 0}):
            r = await http.post("/v1/messages", json={"model": "tool-tiny", "max_tokens": 4, "messages": ASK_WEATHER, **change},
                                headers={"x-api-key": "secret"})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(next(iter(change)))
        # found by the fuzzer: tools that are not a list were a 500
        r = await http.post("/v1/messages/count_tokens", json={"model": "tool-tiny", "messages": ASK_WEATHER, "tools": 1.0},
                            headers={"x-api-key": "secret"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools"), r.text
