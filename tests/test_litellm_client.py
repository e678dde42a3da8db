"""litellm, a real client in its own virtualenv (`.venv-msa`), against the real serve loop on
`tiny`: OpenAI chat (whole, streamed, async, a forced tool call), Anthropic Messages through its
`anthropic/` provider and the Responses API through `litellm.responses`; each call comes back
in its API's shape and is recorded as a turn of the session its header named."""

import asyncio
import json
from pathlib import Path

import pytest

from flywheel.bus import Turn
from flywheel.envs.swe.mini_swe_agent_venv import MSA_VENV, msa_available

from bus_reading import traffic_records

SCRIPT = Path(__file__).parent / "clients" / "litellm_calls.py"


async def test_litellm_chat_messages_and_responses_are_served_and_recorded(served, bus):
    if why := msa_available():
        pytest.skip(f"litellm's virtualenv is missing ({why})")
    process = await asyncio.create_subprocess_exec(
        str(MSA_VENV / "bin" / "python"), str(SCRIPT), served.url, served.model_name,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "PATH": "/usr/bin:/bin"})
    out, err = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode == 0, err.decode()[-3000:]
    got = json.loads(out.decode().strip().splitlines()[-1])

    turns = {t.session_id: t for t in await traffic_records(bus, 6) if isinstance(t, Turn)}
    assert set(turns) == {f"litellm-{name}" for name in ("chat", "stream", "async", "tools", "messages", "responses")}
    assert {turns[f"litellm-{name}"].endpoint for name in ("chat", "stream", "async", "tools")} == {"chat"}
    assert turns["litellm-messages"].endpoint == "messages" and turns["litellm-responses"].endpoint == "responses"
    for name in ("chat", "async"):  # what the client got is what was recorded
        assert got[name]["content"] == turns[f"litellm-{name}"].response["content"]
    assert got["chat"]["completion_tokens"] == len(turns["litellm-chat"].output_ids)
    assert got["stream"]["content"] == turns["litellm-stream"].response["content"] and got["stream"]["chunks"] > 1
    assert got["messages"]["content"] == turns["litellm-messages"].response["content"]
    assert got["responses"]["status"] in ("completed", "incomplete")
    assert got["responses"]["text"] == turns["litellm-responses"].response["content"]
    # a forced call is decoded under its schema, so even untrained tiny produces a valid one
    (call,) = got["tools"]["calls"]
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Paris", "Rome")
    assert [c["id"] for c in turns["litellm-tools"].response["tool_calls"]] == [call["id"]]
