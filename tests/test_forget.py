"""Forgetting an end user (and a tenant), through the real loops on a real bus: after
`POST /admin/forget` nothing of theirs is left on any stream, bucket or file of the run (the
bus's own storage files included: deleted messages are overwritten), the other user's records
stay, the report says which versions trained on them, and the audit log says who asked."""

import asyncio
import hashlib
import json
import subprocess

import httpx
import msgspec
import openai
import pytest

from flywheel.bus import TRAJECTORY_SUBJECT, Trajectory
from flywheel.cli import command
from flywheel.models import load_model
from flywheel.serve.continuation import SessionContinuations
from flywheel.tenants.forget import forget
from flywheel.tenants.registry import Changed, TenantRegistry

from bus_reading import everything_on_the_bus, read
from factories import platform
from tenant_traffic import MARKERS, TENANTS_SETUP, converse, everything_in, learning
from waiting import until


async def test_forgetting_a_user_leaves_nothing_of_theirs_and_keeps_the_others(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        async with learning(serve, nats_url) as train:  # stopped, it checkpoints: digests in the run directory
            await converse(serve, "ada", "ada-session")
            await converse(serve, "bob", "bob-session")
            await until(lambda: train.counts["samples"] == 2)
        before = await everything_on_the_bus(bus)
        assert MARKERS["ada"].encode() in before and b"ada-session" in before  # it was all there
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
            report = (await http.post("/admin/forget", json={"tenant": "acme", "user": "ada"})).json()
            audit = (await http.get("/admin/audit")).json()["data"]
    after = await everything_on_the_bus(bus)
    files = everything_in(tmp_path)
    for leftover in (MARKERS["ada"].encode(), b"ada-session"):
        assert leftover not in after and leftover not in files
    assert MARKERS["bob"].encode() in after and b"bob-session" in after  # the other user's stay
    assert report["records"]["TRAFFIC"] >= 2 and report["records"]["TRAJECTORIES"] == 1 and report["records"]["SAMPLES"] == 1
    assert report["sessions"] == 1 and report["samples"] == 1 and len(report["versions"]) == 1
    [entry] = [e for e in audit if e["action"] == "forget"]
    assert entry["actor"] == "admin" and entry["target"] == "acme/ada" and entry["details"]["samples"] == 1


async def test_flywheel_forget_removes_a_whole_tenant(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        await converse(serve, "ada", "kept-session")
        other = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="other-key", max_retries=0)
        await other.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "GNU-5150 here"}],
                                            max_tokens=2, extra_headers={"X-Session-Id": "other-session"})
        done = await asyncio.to_thread(subprocess.run, command("forget", "--tenant", "other", f"run_dir={tmp_path}",
                                                               f"bus.url={nats_url}"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer other-key"}) as http:
            gone = await http.post("/v1/sessions/other-session/feedback", json={"reward": 1.0})
    after = await everything_on_the_bus(bus)
    assert b"GNU-5150" not in after and b"other-session" not in after and b"kept-session" in after
    assert json.loads(done.stdout)["records"]["TRAFFIC"] >= 1
    assert gone.status_code == 404  # the session is forgotten too, at the gateway that opened it


async def test_every_gateway_drops_what_it_holds_in_memory_of_a_forgotten_user(nats_url, tmp_path, bus):
    """Forgotten through the command line, not this gateway: it hears of it on the bus, and a
    stored response of the user is then not found; the other user's still is."""
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
        stored = {}
        for user in MARKERS:
            response = await client.responses.create(model="tiny", input=f"My code word is {MARKERS[user]}.",
                                                     max_output_tokens=4, extra_headers={"X-User-Id": user})
            stored[user] = response.id
        done = await asyncio.to_thread(subprocess.run, command("forget", "--tenant", "acme", "--user", "ada",
                                                               f"run_dir={tmp_path}", f"bus.url={nats_url}"),
                                       capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        async with httpx.AsyncClient(base_url=f"{serve.url}/v1", headers={"Authorization": "Bearer acme-key"}) as http:
            async def status(user: str) -> int:
                return (await http.get(f"/responses/{stored[user]}")).status_code

            async def ada_gone() -> bool:
                return await status("ada") == 404

            await until(ada_gone)
            assert await status("bob") == 200


def test_continuations_are_forgotten_by_tenant():
    continuations = SessionContinuations(load_model("tiny")[1], max_sessions=8)
    for session in ("acme/1", "acme/2", "other/1"):
        continuations.remember(session, [1, 2, 3], text="abc")
    assert continuations.forget("acme/") == 2
    assert continuations.encode("acme/1", "abcd") == continuations.tokenizer.encode("abcd", add_special_tokens=False)
    assert continuations.encode("other/1", "abcd")[:3] == [1, 2, 3]
    assert continuations.forget("") == 1


async def test_a_forgotten_tenants_keys_open_nothing_at_any_gateway(nats_url, tmp_path):
    """A tenant made at run time and forgotten: its key is refused at once by the gateway that
    forgot it and, once they read the change, by the others; the tenant is no longer listed, and
    its name may be taken again (the old key still refused). A tenant of the configuration keeps
    what was changed at run time: a key revoked stays revoked, training stopped stays stopped."""
    setup = ["serve.admin_key=root", "tenants={acme: {training: opt_out, keys: [acme-key, spare-key]}}"]
    async with platform(nats_url, tmp_path, *setup) as (first, _, _), \
            platform(nats_url, tmp_path / "second", *setup) as (second, _, _):
        async with httpx.AsyncClient(base_url=first.url, headers={"Authorization": "Bearer root"}) as admin:
            assert (await admin.post("/admin/tenants", json={"name": "gone"})).status_code == 200
            key = (await admin.post("/admin/tenants/gone/keys", json={})).json()["key"]
            spare = next(k["id"] for t in (await admin.get("/admin/tenants")).json()["data"] if t["name"] == "acme"
                         for k in t["keys"] if k["id"] != hashlib.sha256(b"acme-key").hexdigest()[:12])
            assert (await admin.delete(f"/admin/tenants/acme/keys/{spare}")).status_code == 200
            assert (await admin.patch("/admin/tenants/acme", json={"training": "off"})).status_code == 200
            await until(lambda: second.tenants.grant_of(key.encode()) is not None)
            await until(lambda: second.tenants.grant_of(b"spare-key") is None)
            for tenant in ("gone", "acme"):
                assert (await admin.post("/admin/forget", json={"tenant": tenant})).status_code == 200
            listed = [t["name"] for t in (await admin.get("/admin/tenants")).json()["data"]]
            assert first.tenants.grant_of(key.encode()) is None and "gone" not in listed
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with httpx.AsyncClient(base_url=first.url, headers={"Authorization": f"Bearer {key}"}) as client:
                assert (await client.post("/v1/chat/completions", json=chat)).status_code == 401
            await until(lambda: second.tenants.grant_of(key.encode()) is None)
            for serve in (first, second):
                assert serve.tenants.grant_of(b"spare-key") is None  # revoked before the forget: still
                assert serve.tenants.grant_of(b"acme-key").training == "off"  # the configuration's key, as changed
            assert (await admin.post("/admin/tenants/gone/keys", json={})).status_code == 404  # as never made
            assert (await admin.post("/admin/tenants", json={"name": "gone"})).status_code == 200  # the name is free
            assert (await admin.post("/admin/tenants", json={"name": "acme"})).status_code == 409  # the configuration's
            assert (await admin.patch("/admin/tenants/acme", json={"store": False})).status_code == 200  # still managed
            assert first.tenants.grant_of(key.encode()) is None


async def test_forgetting_a_user_removes_a_session_they_shared_whole(nats_url, tmp_path, bus):
    """ada asks, bob goes on in the same session: two trajectories, each one person's. Forgetting
    bob removes that session whole (ada's turn in it too: his words are in what followed, hers in
    his prompt) and leaves ada's other session."""
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        await converse(serve, "ada", "kept-session")
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
        asked = [{"role": "user", "content": "ada says GIRAFFE-2718"}]
        first = await client.chat.completions.create(model="tiny", messages=asked, max_tokens=3,
                                                     extra_headers={"X-Session-Id": "family", "X-User-Id": "ada"})
        went_on = [*asked, {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": f"bob says {MARKERS['bob']}"}]
        await client.chat.completions.create(model="tiny", messages=went_on, max_tokens=3,
                                             extra_headers={"X-Session-Id": "family", "X-User-Id": "bob"})
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer acme-key"}) as http:
            (await http.post("/v1/sessions/family/end")).raise_for_status()
        trajectories = await read(bus, TRAJECTORY_SUBJECT, "trajectories", 3, lambda r: isinstance(r, Trajectory))
        shared = sorted((t.user_id, len(t.turns)) for t in trajectories if t.session_id == "acme/family")
        assert shared == [("ada", 1), ("bob", 1)]
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as admin:
            report = (await admin.post("/admin/forget", json={"tenant": "acme", "user": "bob"})).json()
    after = await everything_on_the_bus(bus)
    assert MARKERS["bob"].encode() not in after and b"GIRAFFE-2718" not in after and b"acme/family" not in after
    assert MARKERS["ada"].encode() in after and report["records"]["TRAJECTORIES"] == 2


async def test_a_stored_response_goes_with_anyone_who_asked_in_its_chain(nats_url, tmp_path):
    """bob continues ada's stored response: his holds her words. Forgetting ada forgets it too;
    bob's own chain stays."""
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)

        async def respond(user: str, text: str, previous: str | None = None) -> str:
            response = await client.responses.create(model="tiny", input=text, max_output_tokens=4,
                                                     previous_response_id=previous, extra_headers={"X-User-Id": user})
            return response.id

        hers = await respond("ada", f"My code word is {MARKERS['ada']}.")
        continued = await respond("bob", "And mine?", hers)
        his = await respond("bob", f"My code word is {MARKERS['bob']}.")
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as admin:
            assert (await admin.post("/admin/forget", json={"tenant": "acme", "user": "ada"})).status_code == 200
        async with httpx.AsyncClient(base_url=f"{serve.url}/v1", headers={"Authorization": "Bearer acme-key"}) as http:
            assert [(await http.get(f"/responses/{r}")).status_code for r in (hers, continued, his)] == [404, 404, 200]


async def test_a_request_under_way_when_its_user_is_forgotten_is_not_recorded(nats_url, tmp_path, bus):
    """ada's answers are streaming when she is forgotten: they end as usual (an end waits on what
    is recorded), and nothing of them is kept after, on the bus or as a stored response; bob's
    request after them is recorded."""
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, _, _):
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
        ada = {"X-Session-Id": "ada-s", "X-User-Id": "ada"}
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"ada says {MARKERS['ada']}"}], max_tokens=48,
            temperature=1.0, stream=True, extra_headers=ada)
        response = await client.responses.create(model="tiny", input=f"ada again: {MARKERS['ada']}", max_output_tokens=48,
                                                 temperature=1.0, stream=True, extra_headers={"X-User-Id": "ada"})
        streams = [aiter(chat), aiter(response)]
        for stream in streams:
            await anext(stream)  # under way, and held there until she is forgotten
        await serve.engine.pause("in_place")
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as admin:
            assert (await admin.post("/admin/forget", json={"tenant": "acme", "user": "ada"})).status_code == 200
        await serve.engine.resume()
        rest = [[event async for event in stream] for stream in streams]
        assert rest[0][-1].choices[0].finish_reason is not None and rest[1][-1].type in ("response.completed", "response.incomplete")
        async with httpx.AsyncClient(base_url=f"{serve.url}/v1", headers={"Authorization": "Bearer acme-key"}) as http:
            assert (await http.get(f"/responses/{rest[1][-1].response.id}")).status_code == 404
        await converse(serve, "bob", "bob-session")
        after = await everything_on_the_bus(bus)
    assert MARKERS["ada"].encode() not in after and MARKERS["bob"].encode() in after


async def test_a_session_still_open_when_its_user_is_forgotten_never_becomes_a_trajectory(nats_url, tmp_path, bus):
    """The collector holds ada's turn in her open session when she is forgotten: it drops the
    session, so her next turn there (after the forget: hers to keep) closes a trajectory of that
    turn alone."""
    async with platform(nats_url, tmp_path, *TENANTS_SETUP) as (serve, collect, _):
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)

        async def say(text: str, **headers: str) -> None:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=3,
                                                 extra_headers={"X-Session-Id": "open-s", "X-User-Id": "ada", **headers})

        await say(MARKERS["ada"])
        await until(lambda: collect.tracker.open_sessions == 1)
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as admin:
            assert (await admin.post("/admin/forget", json={"tenant": "acme", "user": "ada"})).status_code == 200
        await until(lambda: collect.tracker.counts.get("forgotten_sessions") == 1)
        await say("Starting over.", **{"X-Session-Done": "true"})
        [trajectory] = await read(bus, TRAJECTORY_SUBJECT, "trajectories", 1, lambda r: isinstance(r, Trajectory))
        after = await everything_on_the_bus(bus)
    assert [t.messages[-1]["content"] for t in trajectory.turns] == ["Starting over."]
    assert MARKERS["ada"].encode() not in after


async def test_an_admin_change_read_before_a_forget_cannot_write_the_tenants_keys_back(nats_url, tmp_path, bus):
    """A PATCH that read the tenant's entry, then a forget, then the PATCH's write: refused (409 at
    the API), so the keys the forget revoked stay revoked."""
    async with platform(nats_url, tmp_path, "serve.admin_key=root", "tenants={acme: {keys: [acme-key]}}") as (serve, _, _):
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as admin:
            assert (await admin.post("/admin/tenants", json={"name": "gone"})).status_code == 200
            key = (await admin.post("/admin/tenants/gone/keys", json={})).json()["key"]
        registry = await TenantRegistry.open(bus)
        stale, revision = await registry.read("gone")
        await forget(bus, "gone")
        with pytest.raises(Changed):
            await registry.write(msgspec.structs.replace(stale, training="opt_out"), revision)
        assert all(k.revoked for k in (await registry.get("gone")).keys)
        await until(lambda: serve.tenants.grant_of(key.encode()) is None)
