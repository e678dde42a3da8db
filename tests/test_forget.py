"""Forgetting an end user (and a tenant), through the real loops on a real bus: after
`POST /admin/forget` nothing of theirs is left on any stream, bucket or file of the run (the
bus's own storage files included: deleted messages are overwritten), the other user's records
stay, the report says which versions trained on them, and the audit log says who asked."""

import asyncio
import json
import subprocess

import httpx
import msgspec
import openai

from flywheel.cli import command
from flywheel.judge.loop import JudgeLoop
from flywheel.train.loop import TrainLoop

from factories import platform
from waiting import until

SETUP = ["serve.admin_key=root", "judge.kind=rule", "train.batch_size=1", "rollout.max_head_offpolicyness=8",
         "tenants={acme: {training: opt_out, pii: \"off\", keys: [acme-key]}, other: {training: opt_out, keys: [other-key]}}"]
MARKERS = {"ada": "ZEBRA-7731", "bob": "OKAPI-4412"}


async def converse(serve, user: str, session: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
    await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"My code word is {MARKERS[user]}."}], max_tokens=4,
        extra_headers={"X-Session-Id": session, "X-User-Id": user})
    async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer acme-key"}) as http:
        (await http.post(f"/v1/sessions/{session}/feedback", json={"reward": 1.0})).raise_for_status()
        (await http.post(f"/v1/sessions/{session}/end")).raise_for_status()


async def everything_on_the_bus(bus) -> bytes:
    """Every message of every stream (key-value buckets and the object store are streams too)."""
    blob = []
    async for name in stream_names(bus):
        info = await bus.js.stream_info(name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                message = await bus.js.get_msg(name, seq)
            except Exception:  # a gap: deleted or expired
                continue
            blob.append(name.encode() + b" " + message.subject.encode() + b" " + (message.data or b"")
                        + msgspec.json.encode(message.headers or {}))
    return b"\n".join(blob)


async def stream_names(bus):
    for info in await bus.js.streams_info():
        yield info.config.name


def everything_in(run_dir) -> bytes:
    return b"\n".join(path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file())


async def test_forgetting_a_user_leaves_nothing_of_theirs_and_keeps_the_others(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *SETUP) as (serve, _, _):
        judge, train = JudgeLoop(serve.config, nats_url), TrainLoop(serve.config, nats_url)
        await judge.start()
        await train.start()
        try:
            await converse(serve, "ada", "ada-session")
            await converse(serve, "bob", "bob-session")
            await until(lambda: train.counts["samples"] == 2)
            await train.finish()  # checkpoint what was trained: its digests are in the run directory
        finally:
            await asyncio.gather(judge.stop(), train.stop())
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
    async with platform(nats_url, tmp_path, *SETUP) as (serve, _, _):
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
