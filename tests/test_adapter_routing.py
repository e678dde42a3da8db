"""Routing requests to personal LoRA adapters (`adapters.kind: lora`), through the real gateway and
embedded engine on a real bus, against PEFT, which made the adapters.

Each end user of a tenant gets its own adapter (`adapters.scope: user`): its turns name it
(`Turn.adapter`) and carry its log-probs and its own versions; an adapter with no published
version yet is the bare base, recorded as the adapter's version 0; a published version
(`WeightUpdate.adapter`) is loaded into the engines without touching the shared weights'
version; a request may name one of its own tenant's adapters in `model`, and another tenant's is
the 404 of one that does not exist; `kind: none` changes nothing; the judge's scoring is the base's.
"""

from __future__ import annotations

import shutil
import uuid

import httpx
import openai
import pytest

from flywheel.bus import WEIGHTS_SUBJECT, WeightUpdate
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model
from flywheel.models.adapter_names import adapter_for, origin, scope_of, user_adapter
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.engine import Engine
from flywheel.serve.engine.server import create_engine_app
from flywheel.serve.engine_choice import bound_versions, version_of
from flywheel.serve.loop import ServeLoop, _newest

from bus_reading import recorded_turns
from factories import RunningApp, announce, platform, prompt, recomputed_logprobs
from peft_adapters import LINEAR, random_adapters
from waiting import until

TOL = 2e-4
TENANTS = 'tenants={acme: {keys: ["key-acme"]}, globex: {keys: ["key-globex"]}}'
LORA = ["adapters.kind=lora", "adapters.scope=user", TENANTS]
ADA, BOB = user_adapter("acme", "ada"), user_adapter("acme", "bob")


@pytest.fixture(scope="module")
def routed_adapters(tmp_path_factory):
    """{name: (directory as a string, its PEFT model)}: three adapters of `tiny` with random (not zero) B."""
    specs = {name: (seed, {"r": 4, "lora_alpha": 8, "target_modules": LINEAR})
             for seed, name in enumerate(("first", "second", "third"), start=1)}
    return {name: (str(path), peft) for name, (path, peft) in random_adapters(tmp_path_factory.mktemp("adapters"), specs).items()}


def client(serve, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key=key, max_retries=0)


async def ask(serve, key: str, user: str | None = None, model: str = "tiny", text: str = "Write some digits.",
              stream: bool = False):
    headers = {"X-Session-Id": uuid.uuid4().hex, **({"X-User-Id": user} if user else {})}
    answer = await client(serve, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=1.0, extra_headers=headers,
        stream=stream)
    return [chunk async for chunk in answer] if stream else answer


async def publish_adapter(bus, name: str, version: int, path: str) -> None:
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"{name}-v{version}", version=version, path=path, step=version,
                                                    adapter=name))


def logprobs_of(model, turn) -> list[float]:
    return recomputed_logprobs(model, list(turn.prompt_ids), list(turn.output_ids))


async def test_each_user_gets_its_own_adapter_and_its_versions(nats_url, tmp_path, bus, routed_adapters, model_and_tokenizer):
    """Bob's adapter was published before the gateway started (found when it starts), Ada's is
    published while it runs: before it, Ada's turns are the bare base's, recorded as her adapter's
    version 0; after it, her adapter's version 1 with its log-probs. Bob's turns are his own
    adapter's (streamed). The shared weights stay on version 0: an adapter's version is never taken for theirs."""
    base, _ = model_and_tokenizer
    (first, first_peft), (second, second_peft) = routed_adapters["first"], routed_adapters["second"]
    await publish_adapter(bus, BOB, 1, second)
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        await until(lambda: serve.pool.adapter_versions == {BOB: 1})
        await ask(serve, "key-acme", "ada")
        before = (await recorded_turns(bus, 1, "before"))[0]
        await publish_adapter(bus, ADA, 1, first)
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        await ask(serve, "key-acme", "ada")
        await ask(serve, "key-acme", "bob", stream=True)
        after = {turn.user_id: turn for turn in (await recorded_turns(bus, 3, "after"))[1:]}
        assert serve.pool.weight_version == 0 and serve.swaps == 0
        assert serve.engine.version == "0" and set(serve.engine.adapters.loaded()) == {BOB, ADA}
    assert (before.adapter, before.user_id, before.tenant) == (ADA, "ada", "acme")
    assert list(before.output_versions) == [0] * len(before.output_ids) and len(before.output_ids) > 0
    assert list(before.output_logprobs) == pytest.approx(logprobs_of(base, before), abs=TOL)
    for user, name, peft in (("ada", ADA, first_peft), ("bob", BOB, second_peft)):
        turn = after[user]
        assert turn.adapter == name and list(turn.output_versions) == [1] * len(turn.output_ids) and turn.output_ids
        assert list(turn.output_logprobs) == pytest.approx(logprobs_of(peft, turn), abs=TOL)
        assert max(abs(a - b) for a, b in zip(turn.output_logprobs, logprobs_of(base, turn))) > 0.05
    assert after["ada"].adapter != after["bob"].adapter


async def test_a_new_version_of_an_adapter_serves_new_turns(nats_url, tmp_path, bus, routed_adapters):
    """Version 2 of Ada's adapter, announced in the same breath as a stale version 1 of it: the
    newest is loaded, and her new turns record version 2 with its log-probs."""
    (first, _), (third, third_peft) = routed_adapters["first"], routed_adapters["third"]
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        await publish_adapter(bus, ADA, 1, first)
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        await publish_adapter(bus, ADA, 2, third)
        await publish_adapter(bus, ADA, 1, first)  # late and older: ignored
        await publish_adapter(bus, BOB, 1, first)  # taken in order: once Bob's is in, the stale one was seen
        await until(lambda: serve.pool.adapter_versions.get(BOB) == 1)
        assert serve.pool.adapter_versions[ADA] == 2
        await ask(serve, "key-acme", "ada")
        (turn,) = await recorded_turns(bus, 1)
    assert turn.adapter == ADA and list(turn.output_versions) == [2] * len(turn.output_ids)
    assert list(turn.output_logprobs) == pytest.approx(logprobs_of(third_peft, turn), abs=TOL)


async def test_a_users_new_adapter_is_served_by_its_tenants_until_it_has_its_own(nats_url, tmp_path, bus, routed_adapters):
    """The trainer starts a user's new adapter from its tenant's: until the user's own is
    published, the tenant's serves them, and the turn is the user's adapter's version 0."""
    tenant_dir, tenant_peft = routed_adapters["third"]
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        await publish_adapter(bus, "acme", 4, tenant_dir)
        await until(lambda: serve.pool.adapter_versions.get("acme") == 4)
        await ask(serve, "key-acme", "ada")
        (turn,) = await recorded_turns(bus, 1)
    assert turn.adapter == ADA and list(turn.output_versions) == [0] * len(turn.output_ids)
    assert list(turn.output_logprobs) == pytest.approx(logprobs_of(tenant_peft, turn), abs=TOL)


async def test_a_request_names_only_its_own_tenants_adapters(nats_url, tmp_path, bus, routed_adapters):
    """acme may name its user's adapter (`tiny:<adapter>` or the name alone), and its own adapter
    that a request without a user is routed to anyway; globex naming either, or acme naming one
    never published, gets exactly the 404 of a model that does not exist."""
    first, _ = routed_adapters["first"]
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        await publish_adapter(bus, ADA, 1, first)
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        own = await ask(serve, "key-acme", None, f"tiny:{ADA}")
        alone = await ask(serve, "key-acme", "bob", ADA)
        turns = await recorded_turns(bus, 2)
        refused = {}
        async with httpx.AsyncClient(base_url=serve.url) as http:
            for model in (f"tiny:{ADA}", ADA, "tiny:acme", "acme", f"tiny:{BOB}", "tiny:globex.u-nobody", "gpt-4", "tiny:"):
                for key in ("key-globex", "key-acme"):
                    response = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                    refused[key, model] = response.status_code, response.json()
    assert own.choices and alone.choices
    assert [(t.adapter, t.user_id) for t in turns] == [(ADA, None), (ADA, "bob")]
    assert all(list(t.output_versions) == [1] * len(t.output_ids) for t in turns)

    def shape(model, answer):
        status, body = answer
        return status, {**body["error"], "message": body["error"]["message"].replace(repr(model), "MODEL")}

    nothing = shape("gpt-4", refused["key-globex", "gpt-4"])
    assert nothing[0] == 404 and nothing[1]["code"] == "model_not_found"
    for (key, model), answer in refused.items():
        if key == "key-acme" and model in (f"tiny:{ADA}", ADA, "tiny:acme", "acme"):
            assert answer[0] == 200
        else:  # another tenant's adapter, one never published, any other model: one answer
            assert shape(model, answer) == nothing, (key, model)


async def test_without_adapters_nothing_changes(nats_url, tmp_path, bus, routed_adapters):
    """`adapters.kind: none`: turns name no adapter, an adapter name is an unknown model, and an
    adapter's announcement is neither loaded nor taken for the shared weights."""
    first, _ = routed_adapters["first"]
    async with platform(nats_url, tmp_path, TENANTS) as (serve, _, _):
        await publish_adapter(bus, ADA, 3, first)
        await ask(serve, "key-acme", "ada")
        with pytest.raises(openai.NotFoundError):
            await ask(serve, "key-acme", "ada", f"tiny:{ADA}")
        (turn,) = await recorded_turns(bus, 1)
        await announce(bus, WeightStore(tmp_path / "weights", keep=2), 1, 0)  # after it: had v3 been taken, not this
        await until(lambda: serve.pool.weight_version == 1)
        assert serve.pool.adapter_versions == {}
    assert turn.adapter is None and turn.user_id == "ada"


async def test_the_judges_scoring_uses_the_bare_base(nats_url, tmp_path, routed_adapters, model_and_tokenizer, monkeypatch):
    """A judge server of a deployment with adapters: `/engine/score` sends the engine no adapter
    and gives the base's log-probs, `/engine/generate` refuses one, and its own chat turns name none."""
    base, tokenizer = model_and_tokenizer
    bodies = []
    from flywheel.serve.backends import in_process

    original = in_process.InProcessEngineClient.generate

    async def spy(self, body):
        bodies.append(body)
        return await original(self, body)

    monkeypatch.setattr(in_process.InProcessEngineClient, "generate", spy)
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "serve.role=judge", *LORA[:2]])
    judge = ServeLoop(config, nats_url)
    await judge.start()
    try:
        messages = [{"role": "user", "content": "What is 12 + 7?"}]
        output = prompt(tokenizer, "19")
        async with httpx.AsyncClient(base_url=judge.url) as http:
            scored = (await http.post("/engine/score", json={"messages": messages, "output_ids": output})).json()
            refused = await http.post("/engine/generate", json={"input_ids": output, "lora_path": "acme",
                                                                "sampling_params": {"max_new_tokens": 1}})
            chat = await http.post("/v1/chat/completions", headers={"X-User-Id": "ada"}, json={
                "model": "tiny", "messages": messages, "max_tokens": 2})
    finally:
        await judge.stop()
    assert refused.status_code == 400 and "base model only" in refused.text
    assert chat.status_code == 200
    assert [("lora_path" in body) for body in bodies] == [False, False]  # the score, the chat
    prompt_ids = bodies[0]["input_ids"][:scored["prompt_tokens"]]
    assert scored["logprobs"] == pytest.approx(recomputed_logprobs(base, prompt_ids, output), abs=TOL)


async def test_the_sglang_client_loads_adapters_and_reads_their_versions(routed_adapters, model_and_tokenizer):
    """Over HTTP (the path to a real SGLang): `load_adapter` is `/load_lora_adapter` with the
    version as its label; a request's `lora_path` gets that adapter's tokens, counted as its
    versions; loading again moves new requests to the new version."""
    _, tokenizer = model_and_tokenizer
    (first, first_peft), (third, third_peft) = routed_adapters["first"], routed_adapters["third"]
    model, _ = load_model("tiny")
    engine = Engine(model, tokenizer, max_batch_size=4).start()
    ids = prompt(tokenizer, "Write some digits.")
    body = {"input_ids": ids, "return_logprob": True, "lora_path": ADA,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    try:
        async with RunningApp(create_engine_app(engine, "tiny", "tiny")) as url:
            sglang = await HTTPEngineClient(url).connect()
            await sglang.load_adapter(ADA, first, 1)
            one = await sglang.generate(dict(body))
            await sglang.load_adapter(ADA, third, 2)
            chunks = [chunk async for chunk in sglang.generate_stream(dict(body))]
            await sglang.close()
    finally:
        engine.stop()
    assert one["meta_info"]["weight_version"] == f"{ADA}@1" and sglang.adapter_versions == {ADA: 2}
    versions = [version_of(span["version"]) for span in one["meta_info"].get("weight_versions", [])] or [1]
    assert set(versions) == {1} and sglang.weight_version == 0
    logprobs = [entry[0] for entry in one["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(recomputed_logprobs(first_peft, ids, one["output_ids"]), abs=TOL)
    streamed_ids = [t for chunk in chunks for t in chunk["output_ids"]]
    streamed_logprobs = [entry[0] for chunk in chunks for entry in chunk["meta_info"].get("output_token_logprobs", [])]
    assert streamed_logprobs == pytest.approx(recomputed_logprobs(third_peft, ids, streamed_ids), abs=TOL)


async def test_against_a_server_that_labels_adapter_tokens_with_its_base_label():
    """A server shaped like SGLang (it refuses to load a name it has, and labels every token with
    its base label): a new version is loaded by unloading and loading the name, a bad directory
    leaves the served version alone, and an adapter's tokens count as the version loaded."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, loaded, calls = FastAPI(), {}, []

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": "0"}

    @app.get("/server_info")
    async def server_info():
        return {}

    @app.post("/load_lora_adapter")
    async def load(body: dict):
        calls.append(("load", body["lora_name"]))
        if body["lora_path"] == "/bad" or body["lora_name"] in loaded:
            why = "already loaded" if body["lora_name"] in loaded else "no such directory"
            return JSONResponse({"success": False, "error_message": why, "loaded_adapters": loaded}, status_code=400)
        loaded[body["lora_name"]] = body["lora_path"]
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    @app.post("/unload_lora_adapter")
    async def unload(body: dict):
        calls.append(("unload", body["lora_name"]))
        loaded.pop(body["lora_name"])
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    @app.post("/generate")
    async def generate(body: dict):
        return {"text": "ab", "output_ids": [5, 6], "meta_info": {
            "weight_version": "0", "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}

    async with RunningApp(app) as url:
        sglang = await HTTPEngineClient(url).connect()
        await sglang.load_adapter("acme", "/one", 1)
        await sglang.load_adapter("acme", "/two", 2)
        with pytest.raises(Exception, match="could not load adapter acme v3"):
            await sglang.load_adapter("acme", "/bad", 3)
        answer = await sglang.generate({"input_ids": [1, 2], "lora_path": "acme"})
        base = await sglang.generate({"input_ids": [1, 2]})
        await sglang.close()
    assert calls == [("load", "acme"), ("load", "acme"), ("unload", "acme"), ("load", "acme"),  # v2 replaces v1
                     ("load", "acme"), ("unload", "acme"), ("load", "acme"), ("load", "acme")]  # v3 fails: v2 again
    assert loaded == {"acme": "/two"} and sglang.adapter_versions == {"acme": 2}
    assert answer["meta_info"]["weight_versions"] == [{"version": "2", "start": 0, "end": 2}]
    assert base["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 2}]


def test_adapter_labels_and_versions():
    """`name@N` is version N of the adapter; a server that labels an adapter's tokens with its base
    label counts them as the adapter version the client knew; of announcements that arrive
    together the newest of the shared weights' and of each adapter's count."""
    assert [version_of(label) for label in (f"{ADA}@3", "shared@12", "acme@x", "@", "7")] == [3, 12, 0, 0, 7]
    meta = {"weight_version": "5", "weight_versions": [{"version": "5", "start": 0, "end": 2}]}
    assert bound_versions(meta, 2, 3, "acme") == 3
    assert meta["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]
    exact = {"weight_version": "acme@4", "weight_versions": [{"version": "acme@2", "start": 0, "end": 1},
                                                              {"version": "acme@4", "start": 1, "end": 2}]}
    assert bound_versions(exact, 2, 4, "acme") == 4 and [s["version"] for s in exact["weight_versions"]] == ["acme@2", "acme@4"]
    updates = [WeightUpdate(id=str(i), version=v, path="p", step=0, adapter=a)
               for i, (v, a) in enumerate([(1, None), (2, "a"), (2, None), (1, "b"), (1, "a")])]
    assert [(u.version, u.adapter) for u in _newest(updates)] == [(2, "a"), (2, None), (1, "b")]


def test_each_scope_and_a_tenants_own_scope_name_the_adapter_a_request_trains():
    """`adapters.scope` names one adapter for the deployment, one a tenant or one a user; a
    tenant's own `adapter_scope` holds for its requests alone, and a user's new adapter starts
    from its tenant's only where the user scope holds."""
    config = load_config(None, ["adapters.kind=lora", "adapters.scope=user",
                                "tenants={acme: {adapter_scope: shared}, globex: {adapter_scope: tenant}, initech: {}}"])
    named = {tenant: adapter_for(scope_of(config, tenant), tenant, "ann") for tenant in ("acme", "globex", "initech", "hooli")}
    assert named == {"acme": "shared", "globex": "globex", "initech": user_adapter("initech", "ann"),
                     "hooli": user_adapter("hooli", "ann")}
    assert adapter_for("user", "initech", None) == "initech"  # a request that names no user: its tenant's
    assert user_adapter("initech", "ann") != user_adapter("initech", "bob") != user_adapter("hooli", "bob")
    assert origin(named["initech"], config) == "initech" and origin(user_adapter("globex", "ann"), config) is None
    assert origin("globex", config) is None and origin("shared", config) is None


async def test_a_gateway_starts_with_every_adapter_in_the_store(nats_url, tmp_path, bus, routed_adapters):
    """The WEIGHTS stream keeps the newest announcements only: a gateway that starts finds the
    newest version of every adapter in the trainer's store, announced or not, before its first request."""
    first, first_peft = routed_adapters["first"]
    shutil.copytree(first, tmp_path / "adapters" / ADA / "v5")
    shutil.copytree(first, tmp_path / "adapters" / ADA / "v4")
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        assert serve.pool.adapter_versions == {ADA: 5}
        await ask(serve, "key-acme", "ada")
        (turn,) = await recorded_turns(bus, 1)
    assert list(turn.output_versions) == [5] * len(turn.output_ids)
    assert list(turn.output_logprobs) == pytest.approx(logprobs_of(first_peft, turn), abs=TOL)
