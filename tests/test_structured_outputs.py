"""Constrained decoding: SGLang's grammar parameters on the engine, `response_format`, and forced
tool calls that always parse and match their schema on chat, Responses and Messages, even with
the untrained `tiny` model (which, unconstrained, writes noise)."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from bus_reading import recorded_turns
from factories import ASK_FORECAST, FORECAST, FORECAST_TOOLS


async def test_the_engine_takes_sglangs_grammar_parameters(engine_url):
    url, _ = engine_url
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for seed in range(3):
            compact = {**FORECAST, "x-guidance": {"whitespace_flexible": False}}  # llguidance's option, else any spacing
            body = {"text": "x", "sampling_params": {"max_new_tokens": 40, "sampling_seed": seed, "json_schema": json.dumps(compact)}}
            answer = (await http.post("/generate", json=body)).json()
            assert answer["meta_info"]["finish_reason"]["type"] == "stop"
            jsonschema.validate(json.loads(answer["text"]), FORECAST)
        regex = (await http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 8, "regex": "[0-9]{3}"}})).json()
        assert len(regex["text"]) == 3 and regex["text"].isdigit()
        lark = {"text": "x", "sampling_params": {"max_new_tokens": 20, "ebnf": 'start: "yes" | "no"'}}
        assert (await http.post("/generate", json=lark)).json()["text"] in ("yes", "no")
        bad = await http.post("/generate", json={"text": "x", "sampling_params": {"ebnf": "start: ("}})
        assert bad.status_code == 400 and "ebnf is not a valid constraint" in bad.json()["error"]
        both = await http.post("/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": 'start: "a"'}})
        assert both.status_code == 400 and "at most one" in both.json()["error"]


async def test_response_format_json_schema_always_parses(served, client, bus):
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    reply = await client.chat.completions.create(model="tiny", messages=ASK_FORECAST, max_tokens=40, n=3, seed=1,
                                                 response_format=response_format)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), FORECAST)
    recorded = await recorded_turns(bus, 3)
    assert all(json.loads(t.sampling["json_schema"])["required"] == ["unit", "days"] for t in recorded)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny", messages=ASK_FORECAST, response_format={"type": "json_schema"})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "alarm"}}])
async def test_forced_calls_parse_and_match_on_chat(served, client, tool_choice):
    for seed in range(4):
        reply = await client.chat.completions.create(model="tiny", messages=ASK_FORECAST, tools=FORECAST_TOOLS, tool_choice=tool_choice,
                                                     max_tokens=40, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "alarm"
        schema = next(t["function"]["parameters"] for t in FORECAST_TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


async def test_a_forced_call_cut_short_is_a_truncated_call_not_content(served, client):
    reply = await client.chat.completions.create(model="tiny", messages=ASK_FORECAST, tools=FORECAST_TOOLS, max_tokens=2,
                                                 tool_choice={"type": "function", "function": {"name": "forecast"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "forecast"


async def test_a_forced_call_and_a_json_schema_format_parse_on_the_responses_api(served):
    responses = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    flat = [{"type": "function", **t["function"]} for t in FORECAST_TOOLS]
    response = await responses.responses.create(model="tiny", input="Forecast?", tools=flat, tool_choice="required",
                                                max_output_tokens=40)
    [call] = [item for item in response.output if item.type == "function_call"]
    schema = next(t["parameters"] for t in flat if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    shaped = await responses.responses.create(model="tiny", input="Forecast?", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), FORECAST)


async def test_a_forced_tool_use_parses_on_the_messages_api(served):
    messages = anthropic.AsyncAnthropic(base_url=served.url, api_key="x", max_retries=0)
    answer = await messages.messages.create(
        model="tiny", max_tokens=40, messages=ASK_FORECAST, tool_choice={"type": "tool", "name": "forecast"},
        tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in FORECAST_TOOLS])
    assert answer.stop_reason == "tool_use"
    [use] = answer.content
    assert use.name == "forecast"
    jsonschema.validate(use.input, FORECAST)
