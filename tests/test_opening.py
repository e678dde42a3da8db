"""A served opening (`memory.opening`): where a person asked to be named and the conversation gives
their name, the gateway writes the opening of the conversation's first reply ("Ada,") and the
model goes on after it, in place of the instruction to greet them. The prompt ends with it, the
client's answer (whole or streamed, any API) starts with it, the turn records it, the next prompt
extends the turn, best of k reads it with each reply, the teacher leaves the opened turn alone,
and the bench asks as the gateway serves."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx
import pytest
from pydantic import ValidationError

from flywheel.bus.instructions import GREETING, Instructions, addressed
from flywheel.bus.streams import memory_subject
from flywheel.config.judge import TeacherConfig
from flywheel.config.memory import MemoryConfig
from flywheel.drills.personal_agent import Asked, opening_of, prompt_ids
from flywheel.judge.teacher import Teacher
from flywheel.judge.wishes import ASPECTS
from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.sessions import session_of
from flywheel.serve.best_of import best_of
from flywheel.serve.continuation import SessionContinuations
from flywheel.serve.ops.tenants import OPEN, Grant
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.served_memory import Served, ServedMemory

from bus_reading import collected
from factories import platform
from waiting import until

SHORTER, NAME = ASPECTS["shorter"], ASPECTS["name"]
SYSTEM = {"role": "system", "content": "You are Ada's personal assistant."}
ADA = {"X-User-Id": "ada"}
ADA_HEADERS = {"x-user-id": "ada"}
OPENED = MemoryConfig().opening_text.format(name="Ada")


def record(said: list[str], aspects: list[str]) -> Instructions:
    return Instructions(id="m", tenant="open", user_id="ada", instructions=said, aspects=aspects, read=aspects,
                        turns=["t"], read_from=1.0, created_at=time.time())


def asking(session: str, *said: dict):
    return (ChatCompletionRequest(model="tiny", messages=list(said)),
            session_of({"x-session-id": session, "x-user-id": "ada"}, None, None, grant=Grant("open", OPEN.training, True)))


def test_the_greeting_is_written_as_the_first_replys_opening_and_the_other_instructions_are_placed():
    memory = ServedMemory("\n\nAsked: $instructions", placement="user", opening="{name},")
    memory.take(record([SHORTER, NAME], ["shorter", "name"]))
    question = {"role": "user", "content": "Hi"}
    body, served = memory.applied(*asking("s1", SYSTEM, question))
    assert served == Served((SHORTER,), ("shorter",), "Ada,") and GREETING in NAME
    assert body.messages[1].text() == f"{SHORTER}\n\nHi"  # no instruction to greet: the opening does
    later = asking("s1", SYSTEM, question, {"role": "assistant", "content": "Ada, hello."}, {"role": "user", "content": "And?"})
    assert memory.applied(*later)[1] == Served((SHORTER,), ("shorter",))  # a conversation is greeted once
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    for constrained in [{"response_format": schema},
                        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}]:
        body = ChatCompletionRequest(model="tiny", messages=[SYSTEM, question], **constrained)
        assert memory.applied(body, asking("s5", SYSTEM)[1])[1].opening == ""  # the answer is not free text
    nameless = memory.applied(*asking("s2", question))[1]
    assert nameless == Served((SHORTER, addressed(NAME, [])), ("shorter", "name"))  # no name to open with: told
    only = ServedMemory("$instructions", opening="{name},")
    only.take(record([NAME], ["name"]))
    body, served = only.applied(*asking("s3", SYSTEM, question))
    assert served == Served(opening="Ada,") and body.messages[0].text() == SYSTEM["content"]  # nothing placed
    without = ServedMemory("$instructions")
    without.take(record([NAME], ["name"]))
    assert without.applied(*asking("s4", SYSTEM, question))[1] == Served((addressed(NAME, ["Ada"]),), ("name",))


def test_the_opening_is_the_configured_text_with_the_name_and_a_text_without_it_is_refused():
    memory = MemoryConfig(opening=True, opening_text="Sure, {name}!")
    assert memory.opened == "Sure, {name}!" and MemoryConfig(opening_text="Sure, {name}!").opened == ""
    served = ServedMemory("$instructions", opening=memory.opened)
    served.take(record([NAME], ["name"]))
    assert served.applied(*asking("s", SYSTEM, {"role": "user", "content": "Hi"}))[1].opening == "Sure, Ada!"
    for wrong in ("Hello,", "{nam},", "{name}, {0}", "{name}, {"):
        with pytest.raises(ValidationError, match="opening must hold"):
            MemoryConfig(opening_text=wrong)


def test_best_of_k_goes_on_from_the_opening_and_reads_it_with_each_reply(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    prompts = PromptBuilder(tokenizer, SessionContinuations(tokenizer, 10))
    body, session = asking("s", SYSTEM, {"role": "user", "content": f"{SHORTER}\n\nTides?"})
    session = replace(session, instructions=(SHORTER,), aspects=("shorter",), opening="Ada,")
    drawn = asyncio.run(best_of(2, body, session, prompts, "tiny", "Ada,"))
    assert drawn is not None and drawn.opening == "Ada,"
    told, untold = tokenizer.decode(drawn.told_ids), tokenizer.decode(drawn.untold_ids)
    assert told.endswith("assistant\nAda,") and untold.endswith("assistant\nAda,") and "Tides?" not in untold
    served_ids, *_ = asyncio.run(prompts.chat(body, session))
    assert served_ids == drawn.told_ids  # the reply is read after the prompt it was sampled from
    assert asyncio.run(best_of(2, body, replace(session, instructions=(), aspects=()), prompts, "tiny", "Ada,")) is not None
    assert asyncio.run(best_of(2, body, session, prompts, "tiny", "", tools_active=True)) is None


def test_the_bench_asks_as_the_gateway_serves(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    asked = Asked(SYSTEM["content"], (SHORTER, NAME), MemoryConfig(placement="user", opening=True))
    chat = asked.chat("Tides?")
    assert opening_of(chat) == OPENED and chat[1]["content"] == f"{SHORTER}\n\nTides?"
    assert asked.served("Tides?") == Served((SHORTER,), (), OPENED)
    assert Asked(SYSTEM["content"], (SHORTER,), asked.memory).served("Tides?") == Served((SHORTER,))  # no greeting asked
    body, session = asking("s", *chat[:-1])
    served_ids, *_ = asyncio.run(PromptBuilder(tokenizer, SessionContinuations(tokenizer, 10)).chat(
        body, replace(session, opening=OPENED)))
    assert prompt_ids(tokenizer, chat) == served_ids
    told = Asked(SYSTEM["content"], (SHORTER, NAME), MemoryConfig(placement="user")).chat("Tides?")
    assert opening_of(told) == "" and addressed(NAME, ["Ada"]) in told[1]["content"]


async def test_through_the_gateway_the_answer_starts_with_the_opening_and_the_next_prompt_extends_it(nats_url, tmp_path, bus):
    """Whole, streamed and Responses answers start with the opening; the turn records the opening at the
    end of its prompt, the model's tokens after it; her second message's prompt extends the first
    turn (one trajectory), and is not opened; the teacher scores only the second turn."""
    async with platform(nats_url, tmp_path, "memory.enabled=true", "memory.placement=user", "memory.opening=true") as (
            serve, _, client):
        await bus.publish(memory_subject("open", "ada"), record([NAME], ["name"]))
        anyone = session_of(ADA_HEADERS, None, None, grant=Grant("open", OPEN.training, True))  # anonymous: not pinned
        await until(lambda: serve.memory.instructions(anyone, asking("x", SYSTEM)[0].messages).opening == OPENED)
        asked = [SYSTEM, {"role": "user", "content": "Where is Lisbon?"}]
        first = await client.chat.completions.create(model="tiny", messages=asked, max_tokens=6,
                                                     extra_headers={**ADA, "X-Session-Id": "ada-1"})
        said = first.choices[0].message.content
        await client.chat.completions.create(model="tiny", max_tokens=4, extra_headers={**ADA, "X-Session-Id": "ada-1"},
                                             messages=[*asked, {"role": "assistant", "content": said},
                                                       {"role": "user", "content": "Shorter."}])
        deltas = [chunk.choices[0].delta.content or "" async for chunk in await client.chat.completions.create(
            model="tiny", messages=asked, max_tokens=6, stream=True, extra_headers={**ADA, "X-Session-Id": "ada-s"})
            if chunk.choices]
        response = await client.responses.create(model="tiny", instructions=SYSTEM["content"], input="Where is Lisbon?",
                                                 max_output_tokens=6, extra_headers={**ADA, "X-Session-Id": "ada-r"})
        async with httpx.AsyncClient() as http:
            (await http.post(f"{serve.url}/v1/sessions/ada-1/end")).raise_for_status()
        trajectories, turns = await collected(bus, 1, 4)
    shown = [delta for delta in deltas if delta]
    assert said.startswith(OPENED) and shown[0].startswith(OPENED) and response.output_text.startswith(OPENED)
    opened, second = turns["ada-1"]
    tokenizer = serve.engine.tokenizer
    assert opened.opening == OPENED and opened.instructions == [] and second.opening == ""
    assert tokenizer.decode(opened.prompt_ids).endswith("assistant\n" + OPENED)
    assert said == OPENED + tokenizer.decode(opened.output_ids, skip_special_tokens=True)
    assert opened.response["content"] == said and "".join(deltas) == turns["ada-s"][0].response["content"]
    trajectory = trajectories["ada-1"]
    assert len(trajectory.segments) == 1 and len(trajectory.turns) == 2  # the second prompt extends the opened turn
    teacher = Teacher(TeacherConfig(), "http://127.0.0.1:9", timeout_s=1.0)
    await teacher.teach(trajectory, {0: "Call me by my name.", 1: "Shorter."})
    await teacher.close()
    assert teacher.counts["failures"] == 1  # asked of the second turn alone (no server there)
