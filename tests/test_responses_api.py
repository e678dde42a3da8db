"""The Responses API (`/v1/responses`) with the official openai client, and Codex CLI's request
shape: answers and event streams match the recorded turns, function calls go both ways, a
`previous_response_id` chain is one session with exact-token continuation, refusals name the
field."""

import json

import httpx
import openai
import pytest

from flywheel.config import load_config
from flywheel.serve.loop import ServeLoop

from bus_reading import recorded_turns
from factories import ASK_WEATHER, WEATHER

FUNCTION = {"type": "function", **WEATHER["function"]}
"""The weather tool in the Responses API's flat shape."""


async def test_an_answer_is_the_recorded_turn(served, client, bus):
    response = await client.responses.create(model="tiny", input="Write some digits.", max_output_tokens=8,
                                             extra_headers={"X-Session-Id": "resp-1"})
    [turn] = await recorded_turns(bus, 1)
    assert turn.endpoint == "responses" and turn.session_id == "resp-1"
    assert turn.messages == [{"role": "user", "content": "Write some digits."}]
    text = served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
    assert response.output_text == text and response.id.startswith("resp_")
    assert response.status == ("incomplete" if turn.finish_reason == "length" else "completed")
    assert response.usage.output_tokens == len(turn.output_ids) and response.usage.input_tokens == len(turn.prompt_ids)


async def test_the_stream_is_the_full_event_sequence(served, client, bus):
    stream = await client.responses.create(model="tiny", input=[{"role": "developer", "content": "Be brief."},
                                                                {"role": "user", "content": "Write some digits."}],
                                           max_output_tokens=12, temperature=0.7, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == deltas == events[-1].response.output_text
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < kinds.index(
        "response.output_text.delta") < kinds.index("response.content_part.done") < kinds.index("response.output_item.done")
    [turn] = await recorded_turns(bus, 1)
    assert served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True) == deltas
    assert turn.messages[0] == {"role": "developer", "content": "Be brief."}


async def test_function_calls_go_out_and_their_outputs_come_back(served_tools, bus):
    _, client = served_tools
    first = await client.responses.create(model="tool-tiny", input=ASK_WEATHER[0]["content"], tools=[FUNCTION], temperature=0,
                                          max_output_tokens=40, extra_headers={"X-Session-Id": "calls"})
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    stream = await client.responses.create(
        model="tool-tiny", tools=[FUNCTION], temperature=0, max_output_tokens=10, stream=True,
        input=[*ASK_WEATHER, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        extra_headers={"X-Session-Id": "calls"})
    events = [event async for event in stream]
    assert events[-1].type in ("response.completed", "response.incomplete")
    first_turn, second_turn = await recorded_turns(bus, 2)
    assert second_turn.messages[1]["tool_calls"][0]["id"] == call.call_id
    assert second_turn.messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}
    assert second_turn.prompt_ids[:len(first_turn.prompt_ids)] == first_turn.prompt_ids


async def test_a_streamed_call_is_one_finished_item(served_tools):
    _, client = served_tools
    stream = await client.responses.create(model="tool-tiny", input=ASK_WEATHER[0]["content"], tools=[FUNCTION], temperature=0,
                                           max_output_tokens=40, stream=True)
    events = [event async for event in stream]
    [done] = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done.item.name == "get_weather" and json.loads(done.item.arguments) == {"city": "Paris"}
    [arguments] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments.arguments == done.item.arguments
    assert not any(e.type == "response.output_text.delta" and "<tool_call>" in e.delta for e in events)
    assert events[-1].response.output[-1].call_id == done.item.call_id


async def test_a_previous_response_chain_is_one_session_continuing_exact_tokens(served, client, bus):
    first = await client.responses.create(model="tiny", input="Count with me.", instructions="You count.", max_output_tokens=6)
    second = await client.responses.create(model="tiny", input="Go on.", instructions="You count.",  # not carried along
                                           previous_response_id=first.id, max_output_tokens=6)
    one, two = await recorded_turns(bus, 2)
    assert one.session_id == two.session_id and not one.session_done
    assert two.prompt_ids[:len(one.prompt_ids) + len(one.output_ids)] == one.prompt_ids + one.output_ids
    assert [m["role"] for m in two.messages] == ["system", "user", "assistant", "user"]
    assert two.messages[2]["content"] == first.output_text
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    assert missing.value.body["param"] == "previous_response_id"
    unstored = await client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


CODEX_BODY = {
    "model": "tiny", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True, "store": False,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "codex-session",
    "client_metadata": {"session_id": "codex-session", "turn_id": "t1"},
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "list the files here"}]},
        {"type": "function_call", "status": "completed", "id": "fc_1", "name": "exec_command",
         "arguments": "{\"cmd\": \"ls\"}", "call_id": "call_1"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "Process exited with code 0\nOutput:\na.txt"},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent", "parameters": {}}]},
        {"type": "web_search", "external_web_access": False},
        {"type": "tool_search", "execution": "client", "parameters": {}},
    ],
}


async def test_codex_cli_requests_are_served_and_stitched_by_its_session_header(nats_url, tmp_path, bus):
    """Codex CLI sends `store: false` on every request: recorded only where the operator says to
    ignore a client's own `store` (`serve.client_store: ignore`)."""
    headers = {"session-id": "codex-session", "originator": "codex_exec", "accept": "text/event-stream"}
    served = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.client_store=ignore"]), nats_url)
    await served.start()
    try:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            async with http.stream("POST", "/v1/responses", json={**CODEX_BODY, "max_output_tokens": 6}, headers=headers) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
        [turn] = await recorded_turns(bus, 1)
        prompt = served.engine.tokenizer.decode(turn.prompt_ids)
    finally:
        await served.stop()
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] in ("response.completed", "response.incomplete")
    assert turn.session_id == "codex-session"
    assert "exec_command" in prompt and "apply_patch" not in prompt


@pytest.mark.parametrize("change, param", [
    ({"truncate": True}, "truncate"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0"),
    ({"tools": [{"type": []}]}, "tools.0"),  # found by the fuzzer: an unhashable type was a 500
    ({"input": [{"type": {"x": 1}}]}, "input.0"),
    ({"text": {"format": {"type": "grammar", "definition": "x"}}}, "text.format"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, None),
])
async def test_what_no_client_sends_is_a_400_naming_it(served, change, param):
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        r = await http.post("/v1/responses", json={"model": "tiny", "input": "hi", **change})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
