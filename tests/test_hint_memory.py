"""The teacher's memory of what each person asked for (flywheel/judge/hint_memory.py,
`judge.teacher.memory`): a hint teaches the person's later turns too, never another person's,
and leaves with the person when they are forgotten."""

from __future__ import annotations

import math

import httpx

from flywheel.bus import SAMPLE_SUBJECT, Sample, Trajectory
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.deploy.deployment import side_server_config
from flywheel.judge.hint_memory import HintMemory
from flywheel.judge.loop import JudgeLoop
from flywheel.serve.loop import ServeLoop

from bus_reading import collected, read
from factories import make_turn, platform
from waiting import until


def trajectory(user: str | None, turns: int = 1, tenant: str = "open", adapter: str | None = None,
               created_at: float = 1000.0) -> Trajectory:
    return Trajectory(id=f"t-{user}-{turns}", session_id="s", segments=[], turns=[make_turn(id=f"t{i}", turn_index=i) for i in range(turns)],
                      next_states=[[] for _ in range(turns)], close_reason="done", tenant=tenant, created_at=created_at, user_id=user, adapter=adapter)


def test_a_hint_teaches_the_same_persons_later_turns_own_hint_first():
    memory = HintMemory(size=2)
    assert memory.teach(trajectory("ada", 2), {1: "Be brief."}) == {1: ["Be brief."]}
    later = memory.teach(trajectory("ada", 2), {0: "Call me Ada."})
    assert later == {0: ["Call me Ada.", "Be brief."], 1: ["Call me Ada.", "Be brief."]}
    assert memory.teach(trajectory("bob"), {}) == {}  # nobody else's
    memory.teach(trajectory("ada"), {0: "Use bullets."})
    assert memory.recall(trajectory("ada")) == ["Use bullets.", "Call me Ada."]  # the newest `size`
    memory.teach(trajectory("ada"), {0: "Call me Ada."})
    assert memory.recall(trajectory("ada")) == ["Call me Ada.", "Use bullets."]  # said again: newest again


def test_a_person_is_an_end_user_on_their_adapter_and_unnamed_traffic_is_one_person():
    memory = HintMemory(size=4)
    memory.teach(trajectory("ada", adapter="acme"), {0: "Be formal."})
    assert memory.recall(trajectory("ada", adapter="acme")) == ["Be formal."]
    assert memory.recall(trajectory("bob", adapter="acme")) == []  # a tenant adapter's other users: not told Ada's words
    assert memory.recall(trajectory("ada")) == [] and memory.recall(trajectory("ada", tenant="other", adapter="acme")) == []
    memory.teach(trajectory(None), {0: "Use bullets."})
    assert memory.recall(trajectory(None)) == ["Use bullets."]


def test_only_the_hints_of_turns_judged_below_zero_are_remembered():
    memory = HintMemory(size=4)
    assert memory.teach(trajectory("ada", 2), {0: "Perfect!", 1: "Shorter."}, remember={1}) == {0: ["Perfect!"], 1: ["Shorter.", "Perfect!"]}
    assert memory.recall(trajectory("ada")) == ["Shorter."]


def test_forgetting_drops_a_users_hints_or_a_tenants_and_older_trajectories_stay_forgotten():
    memory = HintMemory(size=4)
    old = trajectory("ada", created_at=1000.0)
    memory.teach(trajectory("ada"), {0: "Be formal."})
    memory.teach(trajectory("bob"), {0: "Use bullets."})
    memory.teach(trajectory("cy", tenant="other"), {0: "Be brief."})
    memory.forget("open", "ada", at=1001.0)
    assert memory.recall(trajectory("ada")) == [] and memory.recall(trajectory("bob")) == ["Use bullets."]
    memory.teach(old, {0: "Call me Ada."})  # judged after the forget, collected before it
    assert memory.recall(trajectory("ada")) == []
    memory.teach(trajectory("ada", created_at=1002.0), {0: "Call me Ada."})  # collected after: a new start
    assert memory.recall(trajectory("ada")) == ["Call me Ada."]
    memory.forget("open", None, at=1003.0)
    assert memory.recall(trajectory("bob")) == [] and memory.recall(trajectory("ada")) == []
    assert memory.recall(trajectory("cy", tenant="other")) == ["Be brief."]


def test_a_forget_heard_again_drops_nothing_the_person_gave_after_it():
    """The judge reads every forget on the audit log before it restores its people's memory, then
    follows the log from its start (after a restart, or a fault of its follower): a forget of
    someone who came back since is heard again, and what they gave since stays."""
    memory = HintMemory(size=4)
    memory.teach(trajectory("ada"), {0: "Be formal."})
    memory.teach(trajectory("bob"), {0: "Use bullets."})
    memory.forget("open", "ada", at=1001.0)
    memory.teach(trajectory("ada", created_at=1002.0), {0: "Call me Ada."})  # back: a new start
    memory.forget("open", "ada", at=1001.0)  # the same forget, heard again
    assert memory.recall(trajectory("ada")) == ["Call me Ada."]
    memory.forget("open", None, at=1001.5)  # a forget first heard drops all it covers (fail closed)
    assert memory.recall(trajectory("ada")) == [] and memory.recall(trajectory("bob")) == []


def test_people_are_bounded_those_given_a_hint_least_recently_first():
    memory = HintMemory(size=1, max_people=2)
    for user in ("a", "b", "c"):
        memory.teach(trajectory(user), {0: f"hint {user}"})
    assert [memory.recall(trajectory(u)) for u in "abc"] == [[], ["hint b"], ["hint c"]]


async def test_the_judge_loop_teaches_a_persons_next_session_with_their_hint_until_they_are_forgotten(nats_url, tmp_path, bus):
    """Ada corrects a reply (feedback text aimed at it); her next session, which she only thanks,
    is taught under that hint; Bob's is not; once Ada is forgotten, hers are not either."""
    async with platform(nats_url, tmp_path, "judge.kind=next_state", "judge.teacher.enabled=true",
                        "judge.teacher.memory=4") as (serve, _, client):
        server = ServeLoop(side_server_config(serve.config, "judge"), nats_url)
        await server.start()
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()

        async def session(name: str, user: str, feedback: str | None = None) -> None:
            """Greet me; a reply; (a correction aimed at it;) "thanks!"; a reply that ends the session."""
            headers = {"X-Session-Id": name, "X-User-Id": user}
            messages = [{"role": "user", "content": "Greet me."}]
            first = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=6, extra_headers=headers)
            if feedback:
                async with httpx.AsyncClient() as http:
                    aimed = {"interaction_id": first.headers["x-interaction-id"], "text": feedback}
                    (await http.post(f"{serve.url}/v1/sessions/{name}/feedback", json=aimed)).raise_for_status()
            messages += [first.parse().choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "thanks!"}]
            await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                 extra_headers={**headers, "X-Session-Done": "true"})

        def taught(sample: Sample) -> int:
            return sum(not math.isnan(v) for values in sample.teacher_logprobs for v in values)

        try:
            await session("ada-1", "ada", feedback="Call me Ada.")
            await collected(bus, 1, 2)
            await read(bus, SAMPLE_SUBJECT, "first", 1)
            await session("ada-2", "ada")
            await session("bob-1", "bob")
            await collected(bus, 2, 4)
            samples = {s.trajectory.session_id: s for s in await read(bus, SAMPLE_SUBJECT, "later", 3) if await bus.resolve(s)}
            await bus.publish(AUDIT_SUBJECT, AuditEntry(id="forget-ada", action="forget", actor="test", target="open",
                                                        details={"tenant": "open", "user": "ada"}))
            await until(lambda: not judge.memory.recall(trajectory("ada")))
            await session("ada-3", "ada")
            await collected(bus, 1, 2)
            after = {s.trajectory.session_id: s for s in await read(bus, SAMPLE_SUBJECT, "after", 4) if await bus.resolve(s)}
        finally:
            await judge.stop()
            await server.stop()
    assert taught(samples["ada-1"]) > 0
    assert taught(samples["ada-2"]) > 0 and "hint" not in samples["ada-2"].details["turns"][0]  # taught by memory alone
    assert taught(samples["bob-1"]) == 0
    assert taught(after["ada-3"]) == 0
