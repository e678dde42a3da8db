"""Tools end to end: the tool list rendered through the chat template, calls parsed from what the
model generates (a tiny model taught one call: the `tool_model` and `served_tools` fixtures),
streamed, forced by tool_choice, recorded."""

import json

from transformers import AutoTokenizer

from flywheel.formats.tool_calls import HERMES
from flywheel.models import resolve_model
from flywheel.serve.tools.template import adapt_messages, template_support

from bus_reading import recorded_turns
from factories import ASK_WEATHER, WEATHER, WEATHER_CALL


async def test_a_generated_call_comes_back_as_tool_calls(served_tools, bus):
    _, client = served_tools
    reply = await client.chat.completions.create(model="tool-tiny", messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    [turn] = await recorded_turns(bus)
    assert turn.finish_reason == "tool_calls" and turn.response["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_streamed_calls_arrive_in_the_final_delta(served_tools):
    _, client = served_tools
    stream = await client.chat.completions.create(model="tool-tiny", messages=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                                  max_tokens=40, stream=True)
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "<tool_call>" not in content  # the call is never leaked as text
    [final] = [c for c in chunks if c.choices[0].finish_reason]
    assert final.choices[0].finish_reason == "tool_calls"
    [call] = final.choices[0].delta.tool_calls
    assert call.index == 0 and call.function.name == "get_weather"


async def test_tool_choice_forces_a_call_and_none_hides_the_tools(served_tools, bus):
    loop, client = served_tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = await client.chat.completions.create(model="tool-tiny", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named,
                                                 temperature=0, max_tokens=40)
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    none = await client.chat.completions.create(model="tool-tiny", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                                temperature=0, max_tokens=5)
    assert none.choices[0].message.tool_calls is None
    forced, hidden = await recorded_turns(bus, 2)
    tokenizer = loop.engine.tokenizer
    assert tokenizer.decode(forced.prompt_ids).endswith('<tool_call>{"name": "get_weather", "arguments":')
    assert "get_weather" not in tokenizer.decode(hidden.prompt_ids)


async def test_history_with_calls_and_results_is_rendered(served_tools, bus):
    loop, client = served_tools
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    await client.chat.completions.create(model="tool-tiny", messages=history, tools=[WEATHER], max_tokens=3)
    [turn] = await recorded_turns(bus)
    prompt = loop.engine.tokenizer.decode(turn.prompt_ids)
    assert WEATHER_CALL in prompt and "sunny, 21 C" in prompt
    assert turn.turn_index == 1


def test_parsing_keeps_what_is_not_a_call():
    content, calls = HERMES.parse(f"Let me check. {WEATHER_CALL}\n<tool_call>not json</tool_call>")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert content == "Let me check. \n<tool_call>not json</tool_call>".strip()
    assert HERMES.parse("plain text") == ("plain text", [])
    content, calls = HERMES.parse(WEATHER_CALL + WEATHER_CALL.replace("Paris", "Rome"))
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]


def test_templates_without_tool_support_get_the_documented_format():
    tiny = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    smol = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    assert template_support(tiny) == (True, True)
    assert template_support(smol) == (False, False)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = adapt_messages(ASK_WEATHER + [{"role": "assistant", "content": "", "tool_calls": [call]}], [WEATHER], False, False)
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"] and "get_weather" in messages[0]["content"]
    assert messages[-1]["content"] == WEATHER_CALL and "tool_calls" not in messages[-1]
    rendered = smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in rendered and WEATHER_CALL in rendered


async def test_system_messages_partway_through_stay_put_unless_the_template_takes_one_system_message():
    """A system message after the first is rendered where it stands (the history stays
    append-only); a template that refuses that gets it appended to the first system message."""
    from flywheel.serve.api.chat import ChatCompletionRequest
    from flywheel.serve.api.sessions import session_of
    from flywheel.serve.continuation import SessionContinuations
    from flywheel.serve.prompts import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                    {"role": "system", "content": "Agents: general."}]
    body = ChatCompletionRequest(model="tiny", messages=conversation)
    in_place = PromptBuilder(tokenizer, SessionContinuations(tokenizer, 0))
    _, text, _, _ = await in_place.chat(body, session_of({}, None, None))
    assert text.index("hi") < text.index("Agents: general.")
    strict = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    strict.chat_template = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                            "{{ raise_exception('system messages must come first') }}{% endif %}"
                            "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    _, merged, _, _ = await PromptBuilder(strict, SessionContinuations(strict, 0)).chat(body, session_of({}, None, None))
    assert merged == "system: Be brief.\n\nAgents: general.\nuser: hi\nassistant:"
