"""The served memory (`memory.enabled`): the judge reads what a person's corrections ask of replies
(flywheel/judge/instruction_memory.py) and the gateways put it in that person's system message
(flywheel/serve/served_memory.py): instructions, never their words; nobody else's prompt; kept
by a session it started; gone when they are forgotten."""

from __future__ import annotations

import httpx

from flywheel.bus import Sample, Trajectory
from flywheel.bus.streams import MEMORY_SUBJECT
from flywheel.judge.instruction_memory import InstructionMemory
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.wishes import ASPECTS
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest
from flywheel.serve.api.sessions import session_of
from flywheel.serve.ops.tenants import OPEN, Grant
from flywheel.serve.served_memory import ServedMemory
from flywheel.tenants.forget import forget
from flywheel.tenants.instructions import Instructions

from bus_reading import collected, read
from factories import make_turn, platform
from waiting import until

SHORTER, NAME, LIST = ASPECTS["shorter"], ASPECTS["name"], ASPECTS["list"]
TOO_LONG = "Way too long. Keep it short, please."


def corrected(user: str | None, hints: list[str], rewards: list[float], tenant: str = "open", consent: bool = True,
              created_at: float = 1000.0) -> tuple[Trajectory, Sample]:
    """A trajectory of `user` whose turns a judge read `hints` in and scored `rewards`."""
    turns = [make_turn(id=f"t{k}", turn_index=k) for k in range(len(hints))]
    trajectory = Trajectory(id=f"{user}-{created_at}", session_id="s", segments=[], turns=turns,
                            next_states=[[] for _ in turns], close_reason="done", tenant=tenant, user_id=user,
                            consent=consent, created_at=created_at)
    sample = Sample(id=trajectory.id, trajectory_seq=1, reward=0.0, turn_rewards=rewards, judge="next_state",
                    details={"turns": [{"hint": hint} for hint in hints]})
    return trajectory, sample


def test_a_persons_corrections_become_instructions_never_their_words():
    memory = InstructionMemory(size=3)
    read = memory.read(*corrected("ada", [TOO_LONG], [-1.0]))
    assert read.instructions == [SHORTER] and read.user_id == "ada" and read.tenant == "open"
    assert "short, please" not in " ".join(read.instructions)
    # A correction about a fact reads no aspect: hers still ask for shorter replies.
    assert memory.read(*corrected("ada", ["No, the capital of Australia is Canberra."], [-1.0])).instructions == [SHORTER]
    assert memory.read(*corrected("ada", ["Perfect, thanks!"], [1.0])) is None  # approved: not a correction
    assert memory.read(*corrected("bob", ["No, the capital of Australia is Canberra."], [-1.0])).instructions == []
    assert memory.read(*corrected("cy", [TOO_LONG], [-1.0], consent=False)) is None  # not consented: not learned from


def test_a_forgotten_persons_older_corrections_are_not_read_again():
    memory = InstructionMemory(size=3)
    memory.read(*corrected("ada", [TOO_LONG], [-1.0], created_at=1000.0))
    memory.forget("open", "ada", at=1001.0)
    assert memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1000.5)) is None
    assert memory.read(*corrected("ada", ["Call me Ada."], [-1.0], created_at=1002.0)).instructions == [NAME]


def chat(user: str | None, session: str | None, system: str | None = None, tenant: str = "open"):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi"}]
    headers = {**({"x-session-id": session} if session else {}), **({"x-user-id": user} if user else {})}
    return ChatCompletionRequest(model="tiny", messages=messages), session_of(headers, None, None, grant=Grant(tenant, OPEN.training, True))


def instructions(user: str | None, said: list[str], tenant: str = "open", read_from: float = 1000.0) -> Instructions:
    return Instructions(id=f"{tenant}-{user}-{read_from}", tenant=tenant, user_id=user, instructions=said, read_from=read_from)


def test_the_gateway_serves_a_persons_instructions_in_their_system_message_alone():
    memory = ServedMemory("\n\nAsked: $instructions")
    memory.take(instructions("ada", [SHORTER, NAME]))
    body = memory.applied(*chat("ada", "a1", system="You help."))
    assert body.messages[0].content == f"You help.\n\nAsked: {SHORTER} {NAME}" and len(body.messages) == 2
    body = memory.applied(*chat("ada", "a2"))  # no system message: one of them
    assert body.messages[0].role == "system" and body.messages[0].content == f"Asked: {SHORTER} {NAME}"
    for request in (chat("bob", "b1"), chat("ada", "o1", tenant="other"), chat(None, "n1")):
        assert memory.applied(*request) is request[0]  # another user, the same id in another tenant, no user
    completion = CompletionRequest(model="tiny", prompt="Hi")
    assert memory.applied(completion, chat("ada", "a3")[1]) is completion  # a raw prompt has no system message
    memory.take(instructions("ada", [], read_from=1001.0))
    assert len(memory.applied(*chat("ada", "a4")).messages) == 1  # none any more


def test_a_session_keeps_the_instructions_it_started_with():
    memory = ServedMemory("$instructions")
    memory.take(instructions("ada", [SHORTER]))
    assert memory.applied(*chat("ada", "a1")).messages[0].content == SHORTER
    memory.take(instructions("ada", [LIST], read_from=1001.0))
    assert memory.applied(*chat("ada", "a1")).messages[0].content == SHORTER  # its prompts go on extending
    assert memory.applied(*chat("ada", "a2")).messages[0].content == LIST  # her next session: the new


def test_forgetting_drops_a_persons_instructions_and_what_was_read_before_it():
    memory = ServedMemory("$instructions")
    memory.take(instructions("ada", [SHORTER]))
    memory.take(instructions("bob", [NAME]))
    memory.take(instructions("ada", [NAME], tenant="other"))
    memory.applied(*chat("ada", "a1"))
    memory.forget("open", "ada", at=1001.0)
    assert len(memory.applied(*chat("ada", "a1")).messages) == 1  # her open session too
    memory.take(instructions("ada", [LIST], read_from=1000.5))  # read from what she said before the forget
    assert len(memory.applied(*chat("ada", "a2")).messages) == 1 and len(memory) == 2
    memory.forget("open", None, at=1002.0)
    assert len(memory) == 1 and memory.applied(*chat("ada", "o1", tenant="other")).messages[0].content == NAME


async def test_a_correction_reaches_the_persons_next_prompt_and_leaves_with_them(nats_url, tmp_path, bus):
    """Ada says a reply was too long; her next session's prompt holds the instruction (the recorded
    tokens too), Bob's does not; once she is forgotten, its record is gone from the bus and her
    next prompt is as it was."""
    async with platform(nats_url, tmp_path, "judge.kind=next_state", "memory.enabled=true") as (serve, _, client):
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()

        async def session(name: str, user: str, feedback: str | None = None) -> None:
            """Greet me; a reply; (a correction aimed at it;) the end."""
            reply = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "Greet me."}], max_tokens=4,
                extra_headers={"X-Session-Id": name, "X-User-Id": user})
            async with httpx.AsyncClient(base_url=f"{serve.url}/v1/sessions/{name}") as http:
                if feedback:
                    aimed = {"interaction_id": reply.headers["x-interaction-id"], "text": feedback}
                    (await http.post("/feedback", json=aimed)).raise_for_status()
                (await http.post("/end")).raise_for_status()

        try:
            await session("ada-1", "ada", feedback=TOO_LONG)
            [read_back] = await read(bus, MEMORY_SUBJECT, "memory-check")
            await until(lambda: serve.memory.instructions(chat("ada", None)[1]) == (SHORTER,))
            await session("ada-2", "ada")
            await session("bob-1", "bob")
            _, turns = await collected(bus, 3, 3)
            report = await forget(bus, "open", "ada")
            await until(lambda: len(serve.memory) == 0)
            await session("ada-3", "ada")
            _, after = await collected(bus, 1, 1)
        finally:
            await judge.stop()
    assert read_back.instructions == [SHORTER] and TOO_LONG not in str(read_back)
    tokenizer = serve.engine.tokenizer
    assert SHORTER in tokenizer.decode(turns["ada-2"][0].prompt_ids) and turns["ada-2"][0].messages[0]["role"] == "system"
    assert SHORTER not in tokenizer.decode(turns["ada-1"][0].prompt_ids)
    assert SHORTER not in tokenizer.decode(turns["bob-1"][0].prompt_ids)
    assert report.records["MEMORY"] == 1
    assert await bus.last(MEMORY_SUBJECT) is None
    assert SHORTER not in tokenizer.decode(after["ada-3"][0].prompt_ids)
