"""Agent frameworks against the endpoint, unmodified except for base URL and key: the OpenAI
Agents SDK with its default Responses model and with its Chat Completions model, each running a
function tool and a structured final output, each run recorded as one session. The untrained
`tiny` model serves: the first turn forces the tool call (`tool_choice="required"`, which the
SDK resets after a call) and the answer has an `output_type`, so constrained decoding makes
both valid and the run always goes tool call, tool result, answer."""

from typing import Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel

from bus_reading import recorded_turns

set_tracing_disabled(True)  # no export of traces to OpenAI from a test


class Forecast(BaseModel):
    sky: Literal["sunny", "cloudy"]


def weather_agent(model, calls: list[str], settings: ModelSettings) -> Agent:
    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    return Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather],
                 model_settings=settings, output_type=Forecast)


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_openai_agents_runs_a_tool_and_its_run_is_one_session(served, bus, api):
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    calls: list[str] = []
    settings = ModelSettings(tool_choice="required", max_tokens=40, temperature=0.0)
    if api == "responses":
        agent = weather_agent(OpenAIResponsesModel("tiny", client), calls, settings)
        result = await Runner.run(agent, "Weather in Paris?", max_turns=3, auto_previous_response_id=True)
    else:
        settings = ModelSettings(tool_choice="required", max_tokens=40, temperature=0.0,
                                 extra_headers={"X-Session-Id": "agents-chat"})
        agent = weather_agent(OpenAIChatCompletionsModel("tiny", client), calls, settings)
        result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert calls in (["Paris"], ["Rome"])
    assert isinstance(result.final_output, Forecast)
    first, second = await recorded_turns(bus, 2)
    assert first.endpoint == second.endpoint == api
    assert first.session_id == second.session_id and not first.session_id.startswith("anon-")
    assert first.finish_reason == "tool_calls"
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
