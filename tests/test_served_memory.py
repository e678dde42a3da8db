"""The served memory (`memory.enabled`): the judge reads what a person's corrections ask of replies
(flywheel/judge/instruction_memory.py) and the gateways put it in that person's system message
(flywheel/serve/served_memory.py): instructions, never their words; nobody else's prompt; kept
by a session it started; gone when they are forgotten."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import msgspec
import pytest
from nats.js.api import StreamConfig

from flywheel.bus import Sample, Trajectory
from flywheel.bus.instructions import Instructions, addressed
from flywheel.bus.records import AuditEntry, decode, encode
from flywheel.bus.scan import take_all
from flywheel.bus.streams import AUDIT_SUBJECT, MEMORY, MEMORY_SUBJECTS, memory_subject
from flywheel.config import load_config
from flywheel.judge.instruction_memory import InstructionMemory
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.next_state import request_text
from flywheel.judge.wishes import ASPECTS, Wish
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest
from flywheel.serve.api.messages import MessagesRequest
from flywheel.serve.loop import ServeLoop
from flywheel.serve.served_memory import Served, ServedMemory
from flywheel.tenants.forget import forget

from bus_reading import collected, read
from factories import make_turn, platform
from served_people import chat, instructions
from waiting import until

SHORTER, NAME, LIST, FORMAL = ASPECTS["shorter"], ASPECTS["name"], ASPECTS["list"], ASPECTS["formal"]
NAMELESS, DEAR_BOB = addressed(NAME, []), addressed(NAME, ["Bob"])
TOO_LONG = "Way too long. Keep it short, please."


def corrected(user: str | None, hints: list[str], rewards: list[float], tenant: str = "open", consent: bool = True,
              created_at: float = 1000.0) -> tuple[Trajectory, Sample]:
    """A trajectory of `user` whose turns a judge read `hints` in and scored `rewards`."""
    turns = [make_turn(id=f"{user}-{created_at}-t{k}", turn_index=k) for k in range(len(hints))]
    trajectory = Trajectory(id=f"{user}-{created_at}", session_id="s", segments=[], turns=turns,
                            next_states=[[] for _ in turns], close_reason="done", tenant=tenant, user_id=user,
                            consent=consent, created_at=created_at)
    sample = Sample(id=trajectory.id, trajectory_seq=1, reward=0.0, turn_rewards=rewards, judge="next_state",
                    details={"turns": [{"hint": hint} for hint in hints]})
    return trajectory, sample


def test_a_persons_corrections_become_instructions_and_labels_never_their_words():
    memory = InstructionMemory(size=3)
    read = memory.read(*corrected("ada", [TOO_LONG], [-1.0]))
    assert (read.instructions, read.read, read.user_id, read.tenant) == ([SHORTER], ["shorter"], "ada", "open")
    # A correction about a fact reads no aspect: it neither votes nor pushes out what she asked.
    for k in range(4):
        assert memory.read(*corrected("ada", ["No, the capital of Australia is Canberra."], [-1.0], created_at=1001.0 + k)) is None
    assert memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1005.0)).read == ["name", "shorter"]
    assert memory.read(*corrected("ada", ["Perfect, thanks!"], [1.0])) is None  # approved: not a correction
    assert memory.read(*corrected("cy", [TOO_LONG], [-1.0], consent=False)) is None  # not consented: not learned from


def test_of_two_opposite_wishes_asked_as_often_the_newer_is_served():
    memory = InstructionMemory(size=5)
    memory.read(*corrected("ada", ["Could you break that into bullet points?"], [-1.0], created_at=1000.0))
    read = memory.read(*corrected("ada", ["No lists please, just write it out in sentences."], [-1.0], created_at=1001.0))
    assert read.read == ["prose", "list"] and read.instructions == [ASPECTS["prose"]]
    read = memory.read(*corrected("ada", ["Bullets next time, one per line."], [-1.0], created_at=1002.0))
    assert read.instructions == [LIST]  # asked twice


def test_a_casual_tone_is_told_the_teacher_but_never_served():
    memory = InstructionMemory(size=5)
    read = memory.read(*corrected("ada", ["You sound like a robot, loosen up a bit."], [-1.0], created_at=1000.0))
    assert (read.read, read.instructions, read.aspects) == (["casual"], [], [])  # read and kept, not served
    read = memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1001.0))
    assert read.read == ["name", "casual"] and read.instructions == [NAME]  # a tie: the greeting alone
    assert Wish(["You sound like a robot, loosen up a bit."], "instead").told == ASPECTS["casual"]


def test_a_conversation_judged_again_counts_once_and_a_restarted_judge_goes_on_from_the_record():
    memory = InstructionMemory(size=3)
    memory.read(*corrected("ada", [TOO_LONG], [-1.0]))
    again = memory.read(*corrected("ada", [TOO_LONG], [-1.0]))  # redelivered: the same turn
    assert again.read == ["shorter"]
    read = memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1001.0))
    assert read.instructions == [SHORTER, NAME] or read.instructions == [NAME, SHORTER]  # one vote each
    restarted = InstructionMemory(size=3)
    restarted.restore(read)
    again = restarted.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1001.0))  # redelivered after it
    assert again.read == ["name", "shorter"]
    later = restarted.read(*corrected("ada", ["Say my name, Ada, please."], [-1.0], created_at=1002.0))
    assert later.instructions == [NAME] and later.read == ["name", "name", "shorter"]


def test_a_forgotten_persons_older_corrections_are_not_read_again():
    memory = InstructionMemory(size=3)
    memory.read(*corrected("ada", [TOO_LONG], [-1.0], created_at=1000.0))
    memory.forget("open", "ada", at=1001.0)
    assert memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1000.5)) is None
    assert memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1002.0)).instructions == [NAME]
    assert memory.read(*corrected("ada", [TOO_LONG], [-1.0], created_at=1000.8)) is None  # still before it


async def test_the_memory_stream_keeps_each_persons_newest_record_and_a_start_reads_only_those(bus, monkeypatch):
    """A record per person, not per correction (a gateway's start reads the stream whole): the
    same user id in two tenants, and the person who names none (or an empty one), are three people."""
    for k, said in enumerate([[SHORTER], [NAME], [LIST]]):
        await bus.publish(memory_subject("open", "ada"), instructions("ada", said, read_from=1000.0 + k))
    await bus.publish(memory_subject("open", None), instructions(None, [NAME]))
    await bus.publish(memory_subject("acme", "ada"), instructions("ada", [SHORTER], tenant="acme"))
    await bus.publish(memory_subject("open", ""), instructions("", [LIST]))  # the one who names none, again
    kept: list[Instructions] = []
    gets, get_msg = [], bus.js.get_msg
    monkeypatch.setattr(bus.js, "get_msg", lambda *args, **kwargs: gets.append(args) or get_msg(*args, **kwargs))
    last = await take_all(bus, MEMORY.name, kept.append)
    assert len(gets) == 3  # the gaps the replaced records left are not asked for
    info = await bus.js.stream_info(MEMORY.name)
    assert info.state.messages == 3 and last == info.state.last_seq == 6
    assert [(r.tenant, r.user_id, r.instructions) for r in kept] == [
        ("open", "ada", [LIST]), ("acme", "ada", [SHORTER]), ("open", "", [LIST])]
    memory = ServedMemory("\n\nAsked: $instructions")
    for record in kept:
        memory.take(record)
    served = [memory.instructions(chat(user, None, tenant=tenant)[1]).instructions for tenant, user in [("open", "ada"), ("acme", "ada"), ("open", None)]]
    assert served == [(LIST,), (SHORTER,), (LIST,)]


async def test_a_persons_replaced_record_is_erased_from_the_store_not_only_dropped(bus, tmp_path):
    """The stream's limit of one record a subject removes the older one without overwriting its
    bytes; `Bus.replace` erases it first, so no earlier record of a person stays in the files."""
    subject = memory_subject("open", "ada")
    for k in range(2):
        await bus.replace(subject, msgspec.structs.replace(instructions("ada", [SHORTER]), id=f"first-of-ada-{k}"))
    stored = b"".join(f.read_bytes() for f in (tmp_path / "nats").rglob("*") if f.is_file())
    assert b"first-of-ada-1" in stored and b"first-of-ada-0" not in stored
    assert (await bus.js.stream_info(MEMORY.name)).state.messages == 1


async def test_of_two_conversations_of_a_person_judged_at_once_the_newer_record_is_the_one_kept(nats_url, tmp_path, bus):
    """The judge handles conversations concurrently: one whose publish is slow (read first) must not
    land after the next one's record, which holds both reads, and leave her newest correction unserved."""
    judge = JudgeLoop(load_config(None, [f"run_dir={tmp_path}", "judge.kind=next_state", "memory.enabled=true"]), nats_url)
    await judge.start()
    second_publishing, replace = asyncio.Event(), judge.bus.replace

    async def slow_first(subject: str, record: Instructions) -> None:
        if record.read == ["shorter"]:  # the first read: held until the second publishes, or for 2 s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(second_publishing.wait(), 2.0)
        else:
            second_publishing.set()
        await replace(subject, record)
    judge.bus.replace = slow_first
    try:
        await asyncio.gather(judge._remember(*corrected("ada", [TOO_LONG], [-1.0], created_at=1000.0)),
                             judge._remember(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1001.0)))
    finally:
        await judge.stop()
    kept = decode((await bus.js.get_last_msg(MEMORY.name, memory_subject("open", "ada"))).data, Instructions)
    assert kept.read == ["name", "shorter"] and judge.instructions_published == 2


async def test_an_older_versions_memory_subject_is_purged_when_the_stream_is_brought_up_to_date(bus):
    """Before a subject per person, every record was on `flywheel.memory`: on the new stream nothing
    would read or forget them, so bringing the stream up to date purges them."""
    await bus.js.update_stream(StreamConfig(name=MEMORY.name, subjects=["flywheel.memory"], allow_msg_ttl=True))
    for k in range(3):
        await bus.js.publish("flywheel.memory", encode(instructions(f"p{k}", [SHORTER])))
    await bus.ensure_streams()
    info = await bus.js.stream_info(MEMORY.name)
    assert info.config.subjects == [MEMORY_SUBJECTS] and info.state.messages == 0


def test_the_gateway_serves_a_persons_instructions_in_their_system_message_alone():
    memory = ServedMemory("\n\nAsked: $instructions")
    memory.take(instructions("ada", [SHORTER, FORMAL]))
    body = memory.applied(*chat("ada", "a1", system="You help."))[0]
    assert body.messages[0].content == f"You help.\n\nAsked: {SHORTER} {FORMAL}" and len(body.messages) == 2
    body = memory.applied(*chat("ada", "a2"))[0]  # no system message: one of them
    assert body.messages[0].role == "system" and body.messages[0].content == f"Asked: {SHORTER} {FORMAL}"
    memory.take(instructions(None, [LIST]))  # the tenant's traffic that names no user: one person
    for request in (chat("bob", "b1"), chat("ada", "o1", tenant="other")):
        assert memory.applied(*request)[0] is request[0]  # another user, the same id in another tenant
    assert memory.applied(*chat(None, "n1"))[0].messages[0].content == f"Asked: {LIST}"
    assert memory.applied(*chat("", "n2"))[0].messages[0].content == f"Asked: {LIST}"  # an empty id names nobody too
    body = memory.applied(*chat("ada", "a5", system="Be kind.", role="developer"))[0]
    assert body.messages[0].role == "developer" and body.messages[0].content == f"Be kind.\n\nAsked: {SHORTER} {FORMAL}"
    completion = CompletionRequest(model="tiny", prompt="Hi")
    assert memory.applied(completion, chat("ada", "a3")[1])[0] is completion  # a raw prompt has no system message


def test_placed_in_the_user_message_they_go_before_the_first_ones_text_alone():
    """`memory.placement: user`: before the text of the conversation's first user message, so a
    session's next request (its history and the person's reaction) extends the first one's
    messages, and the reaction stays the person's words."""
    memory = ServedMemory("\n\nAsked: $instructions", placement="user")
    memory.take(instructions("ada", [SHORTER, FORMAL]))
    first = memory.applied(*chat("ada", "a1", system="You help."))[0]
    assert [(m.role, m.text()) for m in first.messages] == [("system", "You help."), ("user", f"{SHORTER} {FORMAL}\n\nHi")]
    body, session = chat("ada", "a1", system="You help.")
    later = body.model_copy(update={"messages": [*body.messages, *ChatCompletionRequest(model="tiny", messages=[
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Too long."}]).messages]})
    second = memory.applied(later, session)[0]
    assert second.messages[:2] == first.messages and [m.text() for m in second.messages[2:]] == ["Hello.", "Too long."]
    parts = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert [p.text for p in memory.applied(parts, chat("ada", "a2")[1])[0].messages[0].content] == [f"{SHORTER} {FORMAL}\n\n", "Hi"]
    assert memory.applied(*chat("bob", "b1"))[0].messages[0].text() == "Hi"  # nothing of hers in another's
    alone = ChatCompletionRequest(model="tiny", messages=[{"role": "system", "content": "You help."}])
    assert memory.applied(alone, chat("ada", "a3")[1]) == (alone, Served())  # nowhere to put them: none recorded
    agent = MessagesRequest(model="tiny", max_tokens=4, messages=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]}]).to_chat()
    served, said = memory.applied(agent, chat("ada", "a4")[1])
    assert said.instructions == (SHORTER, FORMAL) and [(m.role, m.text()) for m in served.messages] == [
        ("user", f"{SHORTER} {FORMAL}\n\nWeather?"), ("assistant", ""), ("tool", "Sunny")]  # a tool result as it came
    with pytest.raises(ValueError, match="memory.template"):
        load_config(None, ["memory.placement=user", "memory.template=Asked: $instructions"])


def test_a_session_keeps_the_instructions_it_started_with():
    memory = ServedMemory("$instructions")
    memory.take(instructions("ada", [SHORTER]))
    assert memory.applied(*chat("ada", "a1"))[0].messages[0].content == SHORTER
    memory.take(instructions("ada", [LIST], read_from=1001.0))
    assert memory.applied(*chat("ada", "a1"))[0].messages[0].content == SHORTER  # its prompts go on extending
    assert memory.applied(*chat("ada", "a2"))[0].messages[0].content == LIST  # her next session: the new


def test_instructions_are_held_no_longer_than_their_record_is_kept():
    memory = ServedMemory("$instructions", retention_s={"brief": 60.0})
    memory.take(instructions("ada", [SHORTER], tenant="brief", written=time.time() - 61))
    memory.take(instructions("bob", [SHORTER], tenant="brief"))
    memory.take(instructions("cy", [SHORTER], written=time.time() - 61))  # another tenant: the stream's 7 days
    assert len(memory.applied(*chat("ada", None, tenant="brief"))[0].messages) == 1 and len(memory) == 2
    assert memory.applied(*chat("bob", None, tenant="brief"))[0].messages[0].content == SHORTER
    assert memory.applied(*chat("cy", None))[0].messages[0].content == SHORTER


def test_a_tenant_may_keep_its_people_out_of_the_memory():
    tenants = json.dumps({"quiet": {"keys": ["sk-q"], "memory": False}, "loud": {"keys": ["sk-l"]}})
    judge = JudgeLoop(load_config(None, ["memory.enabled=true", "judge.kind=next_state", f"tenants={tenants}"]), "nats://x")
    assert [judge._remembers(corrected("ada", [TOO_LONG], [-1.0], tenant=t)[0]) for t in ("quiet", "loud")] == [False, True]
    memory = ServedMemory("$instructions", without={"quiet"})
    for tenant in ("quiet", "loud"):
        memory.take(instructions("ada", [SHORTER], tenant=tenant))  # a record from before the setting
    assert len(memory.applied(*chat("ada", "q1", tenant="quiet"))[0].messages) == 1
    assert memory.applied(*chat("ada", "l1", tenant="loud"))[0].messages[0].content == SHORTER


def test_forgetting_drops_a_persons_instructions_and_what_was_read_before_it():
    memory = ServedMemory("$instructions")
    memory.take(instructions("ada", [SHORTER]))
    memory.take(instructions("bob", [FORMAL]))
    memory.take(instructions("ada", [FORMAL], tenant="other"))
    memory.applied(*chat("ada", "a1"))[0]
    memory.forget("open", "ada", at=1001.0)
    assert len(memory.applied(*chat("ada", "a1"))[0].messages) == 1  # her open session too
    memory.take(instructions("ada", [LIST], read_from=1000.5))  # read from what she said before the forget
    assert len(memory.applied(*chat("ada", "a2"))[0].messages) == 1 and len(memory) == 2
    memory.forget("open", None, at=1002.0)
    assert len(memory) == 1 and memory.applied(*chat("ada", "o1", tenant="other"))[0].messages[0].content == FORMAL


async def test_a_correction_reaches_the_persons_next_prompts_and_leaves_with_them(nats_url, tmp_path, bus):
    """Ada says a reply was too long, Bob asks to be named; their next sessions' prompts (Chat
    Completions and Responses) hold their own instruction alone, in the recorded tokens too. Once
    Ada is forgotten her record is gone from the bus, a record read before the forget that comes
    late is not taken, and a gateway that starts then has Bob's before its first request, not hers."""
    async with platform(nats_url, tmp_path, "judge.kind=next_state", "memory.enabled=true") as (serve, _, client):
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()

        async def session(name: str, user: str, feedback: str | None = None, api: str = "chat",
                          said: str = "Greet me.") -> None:
            """`said`; a reply; (a correction aimed at it;) the end."""
            headers = {"X-Session-Id": name, "X-User-Id": user}
            if api == "chat":
                reply = await client.chat.completions.with_raw_response.create(
                    model="tiny", messages=[{"role": "user", "content": said}], max_tokens=4, extra_headers=headers)
            else:
                reply = await client.responses.with_raw_response.create(
                    model="tiny", input=said, max_output_tokens=4, extra_headers=headers)
            async with httpx.AsyncClient(base_url=f"{serve.url}/v1/sessions/{name}") as http:
                if feedback:
                    aimed = {"interaction_id": reply.headers["x-interaction-id"], "text": feedback}
                    (await http.post("/feedback", json=aimed)).raise_for_status()
                (await http.post("/end")).raise_for_status()

        def served(gateway, user: str) -> tuple[str, ...]:
            return gateway.memory.instructions(chat(user, None)[1]).instructions

        try:
            await session("ada-1", "ada", feedback=TOO_LONG)
            await session("bob-1", "bob", feedback="Please call me Bob.")
            await until(lambda: served(serve, "ada") == (SHORTER,) and served(serve, "bob") == (NAMELESS,))
            [ada_read] = await read(bus, MEMORY_SUBJECTS, "memory-check", keep=lambda r: r.user_id == "ada")
            assert ada_read.aspects == ["shorter"] and serve.memory.instructions(chat("bob", None)[1]).aspects == ("name",)
            async with httpx.AsyncClient(base_url=serve.url) as http:  # Messages' count as the model would see it
                counted = [(await http.post("/v1/messages/count_tokens", headers={"X-User-Id": user}, json={
                    "model": "tiny", "messages": [{"role": "user", "content": "Greet me."}]})).json()["input_tokens"]
                    for user in ("ada", "cy")]
            await session("ada-2", "ada")
            await session("ada-2r", "ada", api="responses")
            await session("bob-2", "bob", said="I'm Bob. Greet me.")
            _, turns = await collected(bus, 5, 5)
            report = await forget(bus, "open", "ada")
            await until(lambda: served(serve, "ada") == ())
            taken = serve.memory.taken
            await bus.publish(memory_subject("open", "ada"), instructions("ada", [SHORTER], read_from=ada_read.read_from))  # late
            await until(lambda: serve.memory.taken > taken)
            late = served(serve, "ada")
            second = ServeLoop(serve.config, nats_url)
            await second.start()
            try:
                started_with = served(second, "ada"), served(second, "bob")
            finally:
                await second.stop()
            await session("ada-3", "ada")
            _, after = await collected(bus, 1, 1)
        finally:
            await judge.stop()
    tokenizer = serve.engine.tokenizer

    def prompt(session: str) -> str:
        return tokenizer.decode(turns[session][0].prompt_ids)
    assert ada_read.instructions == [SHORTER] and ada_read.read == ["shorter"]
    assert counted[0] > counted[1]  # hers holds the instruction
    assert SHORTER in prompt("ada-2") and NAMELESS not in prompt("ada-2") and turns["ada-2"][0].messages[0]["role"] == "system"
    assert SHORTER in prompt("ada-2r") and DEAR_BOB in prompt("bob-2") and SHORTER not in prompt("bob-2")
    assert not any(said in prompt(first) for said in (SHORTER, DEAR_BOB, NAMELESS) for first in ("ada-1", "bob-1"))
    assert [turns[s][0].instructions for s in ("ada-1", "ada-2", "ada-2r", "bob-2")] == [[], [SHORTER], [SHORTER], [DEAR_BOB]]
    assert report.records["MEMORY"] == 1
    assert late == () and started_with == ((), (NAMELESS,))
    assert SHORTER not in tokenizer.decode(after["ada-3"][0].prompt_ids)


async def test_in_the_user_message_the_prompt_holds_them_and_the_judges_read_the_persons_words(nats_url, tmp_path, bus):
    """Through a gateway with `memory.placement=user`: the recorded prompt holds her instruction
    before her question, her turns record which instructions they were served, her second request's
    prompt extends her first turn (one trajectory), and what the judges read is her words alone:
    what followed her first reply, and what it answered."""
    async with platform(nats_url, tmp_path, "memory.enabled=true", "memory.placement=user") as (serve, _, client):
        await bus.publish(memory_subject("open", "ada"), instructions("ada", [SHORTER]))
        await until(lambda: serve.memory.instructions(chat("ada", None)[1]).instructions == (SHORTER,))
        headers = {"X-Session-Id": "ada-1", "X-User-Id": "ada"}
        asked = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Greet me."}]
        first = await client.chat.completions.create(model="tiny", messages=asked, max_tokens=4, extra_headers=headers)
        reaction = {"role": "user", "content": "Too long, again."}
        await client.chat.completions.create(model="tiny", max_tokens=4, extra_headers=headers, messages=[
            *asked, {"role": "assistant", "content": first.choices[0].message.content}, reaction])
        chained = {"X-Session-Id": "ada-r", "X-User-Id": "ada"}  # Responses: a stored response continued
        opening = await client.responses.create(model="tiny", input="Greet me.", store=True, max_output_tokens=4,
                                                extra_headers=chained)
        await client.responses.create(model="tiny", input="Too long, again.", previous_response_id=opening.id,
                                      max_output_tokens=4, extra_headers=chained)
        async with httpx.AsyncClient(base_url=f"{serve.url}/v1/sessions") as http:
            for session in ("ada-1", "ada-r"):
                (await http.post(f"/{session}/end")).raise_for_status()
        trajectories, turns = await collected(bus, 2, 4)
    prompt = serve.engine.tokenizer.decode(turns["ada-1"][0].prompt_ids)
    assert f"{SHORTER}\n\nGreet me." in prompt and prompt.index("You help.") < prompt.index(SHORTER)
    trajectory = trajectories["ada-1"]
    assert len(trajectory.segments) == 1 and len(trajectory.turns) == 2  # the second prompt extends the first turn
    assert [t.instructions for t in trajectory.turns] == [[SHORTER], [SHORTER]]
    assert trajectory.next_states[0] == [reaction]
    assert [request_text(t) for t in trajectory.turns] == ["Greet me.", reaction["content"]]
    chain = trajectories["ada-r"]
    assert len(chain.segments) == 1 and [t.instructions for t in chain.turns] == [[SHORTER], [SHORTER]]
    assert [request_text(t) for t in chain.turns] == ["Greet me.", "Too long, again."]


async def test_a_gateway_misses_no_forget_made_while_it_starts_or_while_its_follower_fails(nats_url, tmp_path, bus,
                                                                                           monkeypatch):
    """A forget made after a starting gateway read the audit log and the instructions, before it
    follows the log, reaches it; and one its follower failed on is taken again when it resumes
    (the follower resumed from the log's end before: neither was ever heard)."""
    for user in ("ada", "bob"):
        await bus.publish(memory_subject("open", user), instructions(user, [SHORTER]))
    read_whole = ServedMemory.read.__func__

    async def forget_meanwhile(cls, *args, **kwargs):
        read = await read_whole(cls, *args, **kwargs)
        await bus.publish(AUDIT_SUBJECT, AuditEntry(id="ada", actor="cli", action="forget", target="open/ada",
                                                    details={"tenant": "open", "user": "ada"}))
        return read

    monkeypatch.setattr(ServedMemory, "read", classmethod(forget_meanwhile))
    serve = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "memory.enabled=true"]), nats_url)
    await serve.start()
    try:
        served = lambda user: serve.memory.instructions(chat(user, None)[1]).instructions  # noqa: E731
        await until(lambda: served("ada") == (), timeout_s=10)
        assert served("bob") == (SHORTER,)
        forget_cached, failures = serve.app.state.forget_cached, []

        def failing_once(*args):
            if not failures:
                failures.append(args)
                raise ConnectionError("a passing fault")
            forget_cached(*args)

        serve.app.state.forget_cached = failing_once
        await bus.publish(AUDIT_SUBJECT, AuditEntry(id="bob", actor="cli", action="forget", target="open/bob",
                                                    details={"tenant": "open", "user": "bob"}))
        await until(lambda: served("bob") == (), timeout_s=10)
        assert failures  # the first try failed
    finally:
        await serve.stop()
