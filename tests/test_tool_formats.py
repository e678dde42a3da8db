"""Tool calls for real model families: Llama 3 JSON and Mistral `[TOOL_CALLS]`, chosen from the
chat template, each served with its family's template (tests/data/templates): the `tiny` model
taught the family's call gets it back as `tool_calls` (whole and streamed, nothing leaked), the
call's history renders through the template, and a forced call under the family's grammar is
valid even from the untaught model."""

import json
import types
from pathlib import Path

import jsonschema
import openai
import pytest

from flywheel.formats.tool_calls import FORMATS, HERMES, detect

from bus_reading import recorded_turns
from factories import ASK_WEATHER, WEATHER, serving, teach_tiny

TEMPLATES = Path(__file__).parent / "data" / "templates"
FAMILIES = {
    "llama3_json": ("llama3.1_json.jinja", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": ("mistral_parallel.jinja", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
}


def test_each_format_parses_its_calls_and_leaves_text_alone():
    llama, mistral = FORMATS["llama3_json"], FORMATS["mistral"]
    content, [call] = llama.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert content is None and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    _, calls = llama.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": "a;b"}}')
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert llama.parse("The weather is {fine}.") == ("The weather is {fine}.", [])
    assert llama.parse('{"name": "f"} and more') == ('{"name": "f"} and more', [])
    content, calls = mistral.parse('Let me see. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]')
    assert content == "Let me see." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert mistral.parse("[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", [])
    # What streamed text may be shown (nothing shown before it), and whether a call has begun.
    assert llama.release('  {"na', False) == (0, True) and llama.release("Hello {", False) == (7, False)
    assert mistral.release("Sure [TOOL_C", False) == (5, False) and HERMES.release("ok <tool", False) == (3, False)
    assert HERMES.release("ok <tool_call>{", False) == (3, True)


def test_a_call_begun_and_not_readable_is_malformed_and_nothing_else_is():
    llama, mistral = FORMATS["llama3_json"], FORMATS["mistral"]
    assert HERMES.malformed('<tool_call>{"name": "f", "arguments": {"x": </tool_call>')
    assert not HERMES.malformed('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert not HERMES.malformed("no call here {at all}")
    assert mistral.malformed("[TOOL_CALLS] not json") and not mistral.malformed("plain [text]")
    assert llama.malformed('{"name": "f", "parameters": ') and llama.malformed("<|python_tag|>{oops")
    assert not llama.malformed('The set {"a"} is small.') and not llama.malformed('{"name": "f", "parameters": {}}')


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_forced_call_cut_by_max_tokens_has_arguments_that_end_where_the_json_does(name):
    """A forced call cut inside its closing (`{"a": 2, "b": 3}}</tool`) came back with that tail
    in its arguments, which no JSON parser takes; cut inside the arguments, it is their prefix."""
    fmt = FORMATS[name]
    forced = fmt.forced_prefix(types.SimpleNamespace(name="add"))
    arguments = '{"a": 2, "b": {"c": [1, "}"]}}'
    whole = " " + arguments + fmt.close
    for cut in range(len(" " + arguments), len(whole) + 1):
        call = fmt.truncated_call(forced, whole[:cut])
        assert call["function"]["name"] == "add"
        assert call["function"]["arguments"] == arguments, whole[:cut]
    for cut in range(1, len(" " + arguments)):
        call = fmt.truncated_call(forced, whole[:cut])
        assert call["function"]["arguments"] == whole[1:cut]


def test_the_format_is_read_from_the_template(tiny_path):
    from transformers import AutoTokenizer

    for name, (template, _) in FAMILIES.items():
        assert detect((TEMPLATES / template).read_text()).name == name
    assert detect(AutoTokenizer.from_pretrained(tiny_path).chat_template) is HERMES


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request):
    template, answer = FAMILIES[request.param]
    path = teach_tiny(ASK_WEATHER, [WEATHER], answer, (TEMPLATES / template).read_text())
    return request.param, path


@pytest.fixture
async def family(family_model, nats_url, tmp_path):
    name, path = family_model
    async with serving(path, "fam", nats_url, tmp_path) as loop:
        yield name, openai.AsyncOpenAI(base_url=f"{loop.url}/v1", api_key="x", max_retries=0)


async def test_a_familys_call_comes_back_as_tool_calls_and_its_history_renders(family, bus):
    name, client = family
    reply = await client.chat.completions.create(model="fam", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    stream = await client.chat.completions.create(model="fam", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40,
                                                  stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""  # nothing of the call leaked
    assert chunks[-1].choices[0].delta.tool_calls[0].function.name == "get_weather"
    history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    await client.chat.completions.create(model="fam", messages=history, tools=[WEATHER], temperature=0, max_tokens=4)
    *_, last = await recorded_turns(bus, 3)
    assert last.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_a_forced_call_follows_the_familys_format_and_schema(family):
    name, client = family
    bounded = {"type": "function", "function": {"name": "alarm", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["on"], "properties": {"on": {"type": "boolean"}}}}}
    for seed in range(3):
        reply = await client.chat.completions.create(
            model="fam", messages=[{"role": "user", "content": "Wake me."}], tools=[WEATHER, bounded], max_tokens=30, seed=seed,
            tool_choice={"type": "function", "function": {"name": "alarm"}})
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == "alarm"
        jsonschema.validate(json.loads(call.function.arguments), bounded["function"]["parameters"])
