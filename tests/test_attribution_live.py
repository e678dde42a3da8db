"""Signal attributed to the right tokens, through the real gateway and collector with the real
clients' request shapes: the `openai` client's retries, Claude Code's main agent + Task
sub-agent + title call under one session (`/v1/messages`), an OpenAI Agents SDK handoff
(`/v1/responses`), a client that gives up on a whole answer, and the interaction id that names a
turn for feedback. The untrained `tiny` model serves; forced tool calls (constrained decoding)
make its replies the calls the clients expect."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from pydantic import BaseModel

from flywheel.judge.rule import RuleJudge

from bus_reading import collected, recorded_turns
from factories import platform
from waiting import until

set_tracing_disabled(True)

TASK_TOOL = {"name": "Task", "description": "Launch a sub-agent", "input_schema": {
    "type": "object", "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
    "required": ["description", "prompt"]}}
BASH_TOOL = {"name": "Bash", "description": "Runs a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219", "x-app": "cli", "x-claude-code-session-id": "cc-threads"}


async def feedback(url: str, session: str, **body) -> None:
    async with httpx.AsyncClient() as http:
        (await http.post(f"{url}/v1/sessions/{session}/feedback", json=body)).raise_for_status()


async def test_claude_code_main_agent_sub_agent_and_title_call_are_judged_in_their_own_threads(nats_url, tmp_path, bus):
    """Claude Code's sequence under one session id: the main agent calls Task, the sub-agent runs
    a command and answers, a title call, then the main agent reads the sub-agent's result. Each
    turn's next state is its own conversation's, and every turn is in the trajectory."""
    async with platform(nats_url, tmp_path, "serve.max_new_tokens=48") as (serve, _, _):
        claude = anthropic.AsyncAnthropic(base_url=serve.url, api_key="x", max_retries=0, default_headers=CLAUDE_HEADERS)

        async def ask(system, messages, tools=(), tool=None):
            kw = {"tools": list(tools)} if tools else {}
            if tool:
                kw["tool_choice"] = {"type": "tool", "name": tool}
            return await claude.messages.create(model="tiny", max_tokens=48, system=system, messages=messages, **kw)

        main_system, sub_system = "You are Claude Code, an agent for software engineering.", "You are a general-purpose sub-agent."
        task = [{"role": "user", "content": "Fix the failing test."}]
        main1 = await ask(main_system, task, [TASK_TOOL, BASH_TOOL], "Task")
        [call] = [b for b in main1.content if b.type == "tool_use"]
        sub_task = [{"role": "user", "content": "Find the test that fails and report it."}]
        sub1 = await ask(sub_system, sub_task, [BASH_TOOL], "Bash")
        [command] = [b for b in sub1.content if b.type == "tool_use"]
        sub2 = await ask(sub_system, [*sub_task, {"role": "assistant", "content": [command.model_dump()]},
                                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": command.id,
                                                                    "content": "FAILED test_parse.py::test_empty"}]},
                                      # Claude Code's mid-conversation-system beta: a system message partway through
                                      {"role": "system", "content": "Available agent types for the Agent tool: general."}])
        await ask("Write a 5-word title for this conversation.", [{"role": "user", "content": "Fix the failing test."}])
        await ask(main_system, [*task, {"role": "assistant", "content": [call.model_dump()]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                              "content": "sub-agent: test_empty fails on []"}]}],
                  [TASK_TOOL, BASH_TOOL])
        assert sub2.content
        await feedback(serve.url, "cc-threads", reward=1.0)
        trajectories, _ = await collected(bus, 1, 5)
    trajectory = trajectories["cc-threads"]
    assert len(trajectory.turns) == 5 and sorted(trajectory.threads) == [0, 0, 1, 1, 2]  # nothing lost
    texts = {}
    for turn, state in zip(trajectory.turns, trajectory.next_states):
        first_user = next(m for m in turn.messages if m["role"] == "user")
        texts.setdefault(str(first_user["content"]), []).append(json.dumps(state))
    main_states = texts["Fix the failing test."]
    assert "test_empty fails on []" in main_states[0] and "FAILED" not in main_states[0]  # the sub-agent's result
    sub_states = texts["Find the test that fails and report it."]
    assert len(sub_states) == 2  # one conversation, though its second request added a system message
    assert "FAILED test_parse.py::test_empty" in sub_states[0] and "sub-agent:" not in sub_states[0]
    assert all(state == "[]" for state in (main_states[-1], sub_states[-1]))


class Answer(BaseModel):
    route: Literal["refund", "explain"]


async def test_an_agents_sdk_handoff_starts_a_thread_and_nothing_is_lost(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, "serve.max_new_tokens=48") as (serve, _, _):
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0)
        model = OpenAIResponsesModel("tiny", client)
        billing = Agent(name="billing", instructions="You answer billing questions.", model=model,
                        model_settings=ModelSettings(max_tokens=24, temperature=0.0), output_type=Answer)
        triage = Agent(name="triage", instructions="Hand the user to the right agent.", model=model, handoffs=[billing],
                       model_settings=ModelSettings(tool_choice="required", max_tokens=40, temperature=0.0))
        result = await Runner.run(triage, "I was charged twice.", max_turns=3, auto_previous_response_id=True)
        assert result.last_agent.name == "billing"
        [first, second] = sorted(await recorded_turns(bus, 2), key=lambda t: t.created_at)
        assert first.session_id == second.session_id
        await feedback(serve.url, first.session_id, reward=1.0)
        trajectories, _ = await collected(bus, 1, 2)
    trajectory = trajectories[first.session_id]
    assert [t.id for t in trajectory.turns] == [first.id, second.id] and trajectory.threads == [0, 1]
    assert trajectory.next_states == [[], []]  # the triage turn is not judged by the billing agent's request


async def test_retries_leave_their_orphans_out_and_count_them(nats_url, tmp_path, bus):
    """The same request twice, as a retrying client sends it: with no later turn the second
    answer is the one the client got; when the next turn continues from the first, the first."""
    async with platform(nats_url, tmp_path) as (serve, collect, client):
        ask = [{"role": "user", "content": "What is 2 + 3?"}]
        for session in ("later-wins", "continued-wins"):
            headers = {"X-Session-Id": session}
            got = await client.chat.completions.create(model="tiny", messages=ask, max_tokens=6, seed=1, extra_headers=headers)
            await client.chat.completions.create(model="tiny", messages=ask, max_tokens=6, seed=2, extra_headers=headers)
            if session == "continued-wins":
                history = [*ask, got.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And 3 + 4?"}]
                await client.chat.completions.create(model="tiny", messages=history, max_tokens=6, extra_headers=headers)
            await feedback(serve.url, session, reward=1.0)
        trajectories, turns = await collected(bus, 2, 5)
        assert collect.stats()["retry_orphans"] == 2
    later, continued = trajectories["later-wins"], trajectories["continued-wins"]
    first_try, retry = sorted(turns["later-wins"], key=lambda t: t.created_at)
    assert [t.id for t in later.turns] == [retry.id] and later.retry_orphans == 1
    assert later.segments[0].token_ids == retry.prompt_ids + retry.output_ids
    kept, orphan, follow = sorted(turns["continued-wins"], key=lambda t: t.created_at)
    assert [t.id for t in continued.turns] == [kept.id, follow.id] and continued.retry_orphans == 1
    assert continued.next_states[0] == [{"role": "user", "content": "And 3 + 4?"}]
    [segment] = continued.segments  # the kept answer, then the turn that continued from it
    assert segment.token_ids[:len(kept.prompt_ids) + len(kept.output_ids)] == kept.prompt_ids + kept.output_ids
    assert follow.prompt_ids[:len(segment.token_ids) - len(follow.output_ids)] == segment.token_ids[:len(follow.prompt_ids)]


async def test_a_whole_answer_the_client_gave_up_on_is_recorded_as_such_and_not_trained(nats_url, tmp_path, bus):
    """The `openai` client times out a slow request and retries it; it gets neither answer. The
    gateway notices each disconnect, aborts the generation and records the turn as the client's
    doing (it recorded a finished turn, trained with the episode's outcome)."""
    async with platform(nats_url, tmp_path, "serve.max_new_tokens=4000") as (serve, collect, _):
        impatient = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=1, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=4000,
                extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "impatient"})
        gone = await recorded_turns(bus, 2)
        assert [t.client_disconnected for t in gone] == [True, True] and {t.finish_reason for t in gone} == {"abort"}
        assert all(len(t.output_ids) < 4000 for t in gone)
        await feedback(serve.url, "impatient", reward=1.0)
        await until(lambda: collect.stats()["unused_turns"] + collect.stats()["retry_orphans"] >= 2)
        assert collect.stats()["unused_turns"] + collect.stats()["retry_orphans"] == 2


async def test_the_interaction_id_comes_back_and_aims_feedback_at_its_turn(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path) as (serve, _, client):
        headers = {"X-Session-Id": "aimed"}
        messages = [{"role": "user", "content": "hi"}]
        first = await client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4,
                                                                       extra_headers=headers)
        interaction = first.headers["x-interaction-id"]
        messages += [first.parse().choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        async with client.chat.completions.with_streaming_response.create(model="tiny", messages=messages, max_tokens=4,
                                                                          stream=True, extra_headers=headers) as streamed:
            second = streamed.headers["x-interaction-id"]
            # read to the end: a stream the client leaves unread is abandoned, and a turn the client
            # gave up on is no part of the trajectory (the test above)
            assert [line async for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
        await feedback(serve.url, "aimed", reward=-1.0, interaction_id=interaction)
        await feedback(serve.url, "aimed", reward=1.0)
        trajectories, turns = await collected(bus, 1, 2)
    trajectory = trajectories["aimed"]
    assert [t.id for t in trajectory.turns] == [interaction, second] == [t.id for t in turns["aimed"]]
    verdict = await RuleJudge().score(trajectory)
    assert verdict.turn_rewards == [-1.0, 0.0] and verdict.reward == 1.0
