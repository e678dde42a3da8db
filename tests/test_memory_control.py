"""A person's control of the served memory (`memory.enabled`): they see what it gives them
(`GET /v1/memory`), clear it (`DELETE /v1/memory`; an operator: `POST /admin/memory/clear`) and keep
a conversation out of it (`X-Flywheel-Memory: false`), under their own tenant only
(flywheel/serve/ops/memory_routes.py, flywheel/tenants/memory_clear.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import replace

import httpx
import msgspec
import pytest
from nats.js.errors import NotFoundError

from flywheel.bus import Sample, Trajectory
from flywheel.bus.instructions import Instructions, addressed
from flywheel.bus.records import AuditEntry, decode
from flywheel.bus.scan import take_all
from flywheel.bus.streams import AUDIT, MEMORY, memory_subject
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.judge.hint_memory import HintMemory
from flywheel.judge.instruction_memory import InstructionMemory
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.people_memory import PeopleMemory
from flywheel.judge.wishes import ASPECTS
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.sessions import session_of
from flywheel.serve.loop import ServeLoop
from flywheel.serve.served_memory import Served, ServedMemory

from bus_reading import collected
from factories import make_turn, platform
from served_people import chat, instructions
from waiting import until

SHORTER, NAME, LIST = ASPECTS["shorter"], ASPECTS["name"], ASPECTS["list"]
NAMELESS = addressed(NAME, [])
TENANTS = ("tenants={acme: {keys: [acme-key], training: opt_out}, other: {keys: [other-key], training: opt_out}}",
           "serve.admin_key=operator")


def cleared(tenant: str, user: str | None, at: float) -> AuditEntry:
    return AuditEntry(id=f"clear-{tenant}-{user}", actor="test", action="memory.clear", target=tenant,
                      details={"tenant": tenant, "user": user}, created_at=at)


def test_a_request_says_whether_the_memory_may_take_it():
    assert session_of({}, None, None).memory
    assert session_of({"x-flywheel-memory": "true"}, None, None).memory
    assert not session_of({"x-flywheel-memory": " False"}, None, None).memory
    for said in ("", "maybe", "off"):
        with pytest.raises(APIError) as refused:
            session_of({"x-flywheel-memory": said}, None, None)
        assert refused.value.status == 400 and refused.value.param == "X-Flywheel-Memory"


def test_a_clear_drops_the_persons_instructions_and_what_was_read_before_it_and_a_request_kept_out_gets_none():
    memory = ServedMemory("$instructions")
    for tenant, user in (("acme", "ada"), ("acme", "bob"), ("other", "ada")):
        memory.take(instructions(user, [SHORTER], tenant=tenant, read_from=1000.0))
    served = lambda user, tenant="acme": memory.instructions(chat(user, None, tenant=tenant)[1]).instructions  # noqa: E731
    body, session = chat("ada", "s-1", tenant="acme")
    assert memory.applied(body, replace(session, memory=False)) == (body, Served())
    assert memory.applied(body, session)[1].instructions == (SHORTER,)

    memory.hear(cleared("acme", "ada", at=1001.0))
    assert served("ada") == () and served("bob") == (SHORTER,) and served("ada", "other") == (SHORTER,)
    memory.take(instructions("ada", [LIST], tenant="acme", read_from=1000.5))  # read before the clear: late
    assert served("ada") == ()
    memory.take(instructions("ada", [NAME], tenant="acme", read_from=1002.0))
    assert served("ada") == (NAMELESS,)
    memory.hear(cleared("acme", "ada", at=1001.0))  # heard again (a follower resumed on it): what came since stays
    assert served("ada") == (NAMELESS,)
    memory.hear(cleared("acme", None, at=1003.0))  # all of a tenant's people
    assert served("ada") == served("bob") == () and served("ada", "other") == (SHORTER,)


async def test_a_person_sees_what_the_memory_gives_them_and_nobody_elses(nats_url, tmp_path, bus):
    """`GET /v1/memory`: the instructions the person named in X-User-Id is served, under the
    caller's tenant only; a tenant whose people are kept out of the memory says it is off."""
    await bus.publish(memory_subject("acme", "ada"), instructions("ada", [SHORTER, NAME], tenant="acme"))
    await bus.publish(memory_subject("other", "ada"), instructions("ada", [LIST], tenant="other"))
    tenants = "tenants={acme: {keys: [acme-key]}, other: {keys: [other-key], memory: false}}"
    serve = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "memory.enabled=true", tenants]),
                      nats_url)
    await serve.start()
    try:
        async with httpx.AsyncClient(base_url=serve.url) as http:
            async def memory_of(key: str, user: str | None) -> dict:
                headers = {"Authorization": f"Bearer {key}", **({"X-User-Id": user} if user else {})}
                response = await http.get("/v1/memory", headers=headers)
                assert response.status_code == 200, response.text
                return response.json()

            adas = await memory_of("acme-key", "ada")
            assert adas["enabled"] and adas["instructions"] == [SHORTER, NAME]
            assert (await memory_of("acme-key", "bob"))["instructions"] == []
            assert (await memory_of("acme-key", None))["instructions"] == []  # the tenant's unnamed traffic
            assert await memory_of("other-key", "ada") == {"object": "memory", "enabled": False, "instructions": [],
                                                          "aspects": []}
    finally:
        await serve.stop()


def conversation(user: str, memory: bool = True, at: float = 1000.0) -> Trajectory:
    """A one-turn conversation of acme's `user`, collected at `at`; `memory`: its turn's `Turn.memory`."""
    return Trajectory(id=f"{user}-{at}", session_id="s", segments=[], turns=[make_turn(id=f"{user}-{at}", memory=memory)],
                      next_states=[[]], close_reason="done", tenant="acme", user_id=user, consent=True, created_at=at)


def test_the_judge_remembers_nothing_of_a_conversation_kept_out_and_forgets_what_a_clear_covers(tmp_path):
    """Kept out: not told the person's remembered hints, its own not remembered, no practice
    request kept, no correction read. A clear heard on the audit log empties the judge's memories
    of that person (the teacher's hints, practice requests, corrections), and no one else's."""
    hints = HintMemory(size=4)
    hints.teach(conversation("ada"), {0: "Be brief."})
    assert hints.teach(conversation("ada", memory=False), {0: "Use bullets."}) == {0: ["Use bullets."]}
    assert hints.recall(conversation("ada")) == ["Be brief."]
    requests = PeopleMemory(size=2)
    requests.keep(conversation("ada", memory=False), ["her question"])
    assert requests.recall(conversation("ada")) == []
    corrections = InstructionMemory(size=3)
    trajectory = conversation("ada", memory=False)
    sample = Sample(id=trajectory.id, trajectory_seq=1, reward=0.0, turn_rewards=[-1.0], judge="next_state",
                    details={"turns": [{"hint": "Way too long. Keep it short, please."}]})
    assert corrections.read(trajectory, sample) is None
    assert corrections.read(conversation("ada"), msgspec.structs.replace(sample, id="on")).instructions == [SHORTER]

    judge = JudgeLoop(load_config(None, [f"run_dir={tmp_path}", "judge.kind=next_state", "judge.teacher.memory=4",
                                         "memory.enabled=true"]), "nats://127.0.0.1:1")
    for user in ("ada", "bob"):
        judge.memory.teach(conversation(user), {0: "Be brief."})
        judge.instructions.keep(conversation(user), [(f"{user}-turn", "shorter")])
    judge._heard(cleared("acme", "ada", at=1001.0))
    assert judge.memory.recall(conversation("ada")) == [] and judge.instructions.recall(conversation("ada")) == []
    assert judge.memory.recall(conversation("bob")) == ["Be brief."] and judge.instructions.recall(conversation("bob"))
    judge.memory.teach(conversation("ada", at=1000.5), {0: "Use bullets."})  # said before the clear: not again
    assert judge.memory.recall(conversation("ada")) == []


def test_a_record_a_judge_made_before_hearing_of_a_clear_is_not_served_after_it():
    """The judge reads ada's correction (collected at 1000), her memory is cleared at 1001, and before
    the judge hears of it, it reads her next conversation's (1002): that record holds both. It says
    it was read from 1000 on, so a gateway that heard of the clear does not serve it (said 1002, it
    served the cleared "shorter" again)."""
    corrections = InstructionMemory(size=3)

    def read(user: str, hint: str, at: float):
        trajectory = conversation(user, at=at)
        return corrections.read(trajectory, Sample(id=trajectory.id, trajectory_seq=1, reward=0.0, turn_rewards=[-1.0],
                                                   judge="next_state", details={"turns": [{"hint": hint}]}))

    read("ada", "Way too long. Keep it short, please.", 1000.0)
    record = read("ada", "Please call me Ada.", 1002.0)
    assert record.read == ["name", "shorter"] and record.read_from == 1000.0
    memory = ServedMemory("$instructions")
    memory.hear(cleared("acme", "ada", at=1001.0))
    memory.take(record)
    assert memory.of("acme", "ada").instructions == ()
    corrections.forget("acme", "ada", 1001.0)  # once the judge hears of it: her next record is hers since
    memory.take(read("ada", "Please call me Ada.", 1003.0))
    assert memory.of("acme", "ada").instructions == (NAME,)


async def stored(bus, tenant: str, user: str):
    """The person's record on MEMORY, or None."""
    try:
        return decode((await bus.js.get_last_msg(MEMORY.name, memory_subject(tenant, user))).data, Instructions)
    except NotFoundError:
        return None


async def test_a_person_clears_their_memory_and_keeps_a_conversation_out_of_it(nats_url, tmp_path, bus):
    """Ada of acme corrects a reply; so do Bob of acme and another tenant's Ada. Other's key clearing
    "ada" clears its own Ada alone. Acme's clearing Ada: she is served nothing at once, at another
    gateway once it reads the audit log, her record leaves the bus, and the judge reads her next
    correction alone (not the one before). A conversation she keeps out of the memory is served
    no instruction and none is read from it. The operator clears the rest of acme; a gateway that
    starts after all that serves each person what is theirs now."""
    async with platform(nats_url, tmp_path, "judge.kind=next_state", "memory.enabled=true", *TENANTS) as (serve, *_):
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        second = ServeLoop(serve.config, nats_url)
        await second.start()
        http = httpx.AsyncClient(base_url=serve.url)

        async def session(key: str, name: str, user: str, correction: str, **headers: str) -> str:
            """A conversation of `user`'s, a correction aimed at its reply, its end; its prompt."""
            headers = {"Authorization": f"Bearer {key}", "X-Session-Id": name, "X-User-Id": user, **headers}
            reply = await http.post("/v1/chat/completions", headers=headers, json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Greet me."}]})
            assert reply.status_code == 200, reply.text
            aimed = {"interaction_id": reply.headers["x-interaction-id"], "text": correction}
            for path, body in (("feedback", aimed), ("end", None)):
                (await http.post(f"/v1/sessions/{name}/{path}", headers=headers, json=body)).raise_for_status()
            return reply.headers["x-interaction-id"]

        async def memory_of(key: str, user: str, method: str = "GET") -> httpx.Response:
            return await http.request(method, "/v1/memory", headers={"Authorization": f"Bearer {key}", "X-User-Id": user})

        def served(gateway: ServeLoop, user: str, tenant: str = "acme") -> tuple[str, ...]:
            return gateway.memory.instructions(chat(user, None, tenant=tenant)[1]).instructions

        try:
            await session("acme-key", "ada-1", "ada", "Way too long. Keep it short, please.")
            await session("acme-key", "bob-1", "bob", "Way too long. Keep it short, please.")
            await session("other-key", "ada-1", "ada", "Please call me Ada.")
            await until(lambda: served(second, "ada") == served(second, "bob") == (SHORTER,)
                        and served(second, "ada", "other") == (NAMELESS,))

            assert (await memory_of("other-key", "ada", "DELETE")).json() == {"object": "memory", "deleted": True}
            assert (await memory_of("acme-key", "ada")).json()["instructions"] == [SHORTER]
            assert (await memory_of("other-key", "ada")).json()["instructions"] == []
            assert (await memory_of("acme-key", "ada", "DELETE")).status_code == 200
            assert (await memory_of("acme-key", "ada")).json()["instructions"] == []  # at once, here
            await until(lambda: served(second, "ada") == ())  # there, once it read the audit log
            assert served(second, "bob") == (SHORTER,)
            assert await stored(bus, "acme", "ada") is None and (await stored(bus, "acme", "bob")).read == ["shorter"]
            refused = await http.delete("/v1/memory", headers={"Authorization": "Bearer acme-key"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-User-Id"

            await session("acme-key", "ada-2", "ada", "Please call me Ada.")
            await until(lambda: served(second, "ada") == (NAMELESS,))
            assert (await stored(bus, "acme", "ada")).read == ["name"]  # the correction before the clear is gone

            kept_out = await session("acme-key", "ada-3", "ada", "Use a bulleted list, please.", **{
                "X-Flywheel-Memory": "false"})
            await session("acme-key", "bob-2", "bob", "Use a bulleted list, please.")  # read where not kept out
            await until(lambda: judge.scored + sum(judge.unscored.values()) >= 6)
            assert judge.scored == 6  # ada-3 judged too: its correction was there to read
            assert (await stored(bus, "acme", "ada")).read == ["name"]
            assert (await stored(bus, "acme", "bob")).read == ["list", "shorter"]

            admin = {"Authorization": "Bearer operator"}
            assert (await http.post("/admin/memory/clear", headers={"Authorization": "Bearer acme-key"},
                                    json={"tenant": "acme"})).status_code == 401
            assert (await http.post("/admin/memory/clear", headers=admin, json={"tenant": "acme"})).status_code == 200
            await until(lambda: served(second, "ada") == served(second, "bob") == ())
            assert await stored(bus, "acme", "bob") is None and await stored(bus, "acme", "ada") is None
            _, turns = await collected(bus, 6, 6)
            entries: list[AuditEntry] = []
            await take_all(bus, AUDIT.name, entries.append)
        finally:
            await http.aclose()
            await second.stop()
            await judge.stop()
    third = ServeLoop(serve.config, nats_url)
    await third.start()
    try:
        assert served(third, "ada") == served(third, "bob") == () and served(third, "ada", "other") == ()
    finally:
        await third.stop()
    [ada_3] = turns["acme/ada-3"]
    assert ada_3.id == kept_out and not ada_3.memory and ada_3.instructions == []
    assert NAMELESS not in serve.engine.tokenizer.decode(ada_3.prompt_ids)
    assert [(e.actor, e.target) for e in entries if e.action == "memory.clear"] == [
        ("tenant:other", "other/ada"), ("tenant:acme", "acme/ada"), ("admin", "acme")]


async def test_an_operator_sees_and_clears_a_persons_memory_from_a_shell(nats_url, tmp_path, bus):
    """`flywheel memory --tenant T --user U [--clear]`: the person's instructions, and their memory
    cleared on the audit log as the operator; another person's stays."""
    for user in ("ada", "bob"):
        await bus.publish(memory_subject("acme", user), instructions(user, [SHORTER], tenant="acme"))

    async def memory(*args: str) -> dict:
        done = await asyncio.to_thread(subprocess.run, command("memory", "--tenant", "acme", *args, f"run_dir={tmp_path}",
                                                               f"bus.url={nats_url}"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert (await memory("--user", "ada"))["instructions"] == [SHORTER]
    assert (await memory("--user", "ada", "--clear", "--operator", "support"))["records_erased"] == 1
    assert (await memory("--user", "ada"))["instructions"] == [] and await stored(bus, "acme", "ada") is None
    assert (await stored(bus, "acme", "bob")).instructions == [SHORTER]
    entries: list[AuditEntry] = []
    await take_all(bus, AUDIT.name, entries.append)
    assert [(e.actor, e.target) for e in entries if e.action == "memory.clear"] == [("support", "acme/ada")]
