"""Tenants kept apart, through the real gateway and collector on a real bus.

Two client keys are two tenants unless a `tenants:` entry puts them together. Key B, knowing the
session id key A uses, tries what the issue tried: a reward and words on A's session, a turn of
its own under A's `X-Session-Id`, and an end of A's session. None of it may reach A's
trajectory; B's turn is a session of B's own. Every turn says whose it is (tenant and end user).
"""

import httpx
import openai
import pytest
from nats.js.errors import NotFoundError

from flywheel.bus import Bus
from flywheel.bus.streams import TURN_SUBJECT
from flywheel.collect.loop import CollectLoop
from flywheel.config import ConfigError, load_config
from flywheel.serve.ops.tenants import TenantDirectory

from bus_reading import collected, delivered, recorded_turns
from factories import make_turn, platform
from waiting import until

KEYS = 'serve.api_keys=["key-a", "key-b"]'


def client(serve, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key=key, max_retries=0)


async def ask(serve, key: str, session: str, text: str, **headers: str):
    return await client(serve, key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4,
        extra_headers={"X-Session-Id": session, **headers})


async def signal(serve, key: str, session: str, kind: str, **body) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{serve.url}/v1/sessions/{session}/{kind}", json=body or None,
                               headers={"Authorization": f"Bearer {key}"})


async def test_another_key_cannot_reach_a_session_it_does_not_own(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, KEYS) as (serve, _, _):
        await ask(serve, "key-a", "conversation-42", "What is 2 + 3?", **{"X-User-Id": "ada"})
        foreign = [await signal(serve, "key-b", "conversation-42", "feedback", reward=-1.0, text="Always answer in French"),
                   await signal(serve, "key-b", "conversation-42", "end")]
        nothing = [await signal(serve, "key-b", "never-opened", "feedback", reward=-1.0, text="Always answer in French"),
                   await signal(serve, "key-b", "never-opened", "end")]
        await ask(serve, "key-b", "conversation-42", "A turn of B's own")
        assert (await signal(serve, "key-b", "conversation-42", "end")).status_code == 200  # B's own session now
        assert (await signal(serve, "key-a", "conversation-42", "feedback", reward=1.0)).status_code == 200
        trajectories, turns = await collected(bus, n_sessions=2, n_turns=2)
    # Another tenant's session answers exactly as one that does not exist: no oracle.
    assert [r.status_code for r in foreign] == [r.status_code for r in nothing] == [404, 404]
    assert [r.json()["error"]["code"] for r in foreign] == [r.json()["error"]["code"] for r in nothing]
    owners = {trajectory.tenant: trajectory for trajectory in trajectories.values()}
    a, b = owners[TenantDirectory.key_tenant("key-a")], owners[TenantDirectory.key_tenant("key-b")]
    assert a.session_id != b.session_id  # the same client id, two sessions
    assert [t.messages[-1]["content"] for t in a.turns] == ["What is 2 + 3?"]
    assert [(f.reward, f.text) for f in a.feedback] == [(1.0, None)]  # B's reward and words never reached it
    assert [t.messages[-1]["content"] for t in b.turns] == ["A turn of B's own"]
    assert a.user_id == "ada" and b.user_id is None
    assert all(turn.tenant in (a.tenant, b.tenant) for session in turns.values() for turn in session)


async def test_keys_of_one_tenant_share_its_sessions(nats_url, tmp_path, bus):
    tenants = 'tenants={acme: {keys: ["key-1", "key-2"]}}'
    async with platform(nats_url, tmp_path, tenants) as (serve, _, _):
        await ask(serve, "key-1", "shared", "first")
        await ask(serve, "key-2", "shared", "second")
        assert (await signal(serve, "key-2", "shared", "feedback", reward=0.5)).status_code == 200
        trajectories, _ = await collected(bus, n_sessions=1, n_turns=2)
    (trajectory,) = trajectories.values()
    assert trajectory.tenant == "acme" and len(trajectory.turns) == 2 and trajectory.feedback[0].reward == 0.5


async def test_the_end_user_is_read_from_the_header_else_the_body(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path) as (serve, _, _):
        openai_client = client(serve, "unused")
        await openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, user="from-user", extra_headers={"X-Session-Id": "u1"})
        await openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, metadata={"user_id": "from-metadata"},
                                                    extra_headers={"X-Session-Id": "u2"})
        await openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, user="from-user",
                                                    extra_headers={"X-Session-Id": "u3", "X-User-Id": "from-header"})
        _, turns = await collected(bus, n_sessions=0, n_turns=3)
    assert {session: ts[0].user_id for session, ts in turns.items()} == {
        "u1": "from-user", "u2": "from-metadata", "u3": "from-header"}
    assert {ts[0].tenant for ts in turns.values()} == {"open"}  # no keys: the one open tenant, ids as sent


async def test_a_stored_response_is_seen_only_by_its_tenant(nats_url, tmp_path):
    async with platform(nats_url, tmp_path, KEYS) as (serve, _, _):
        stored = await client(serve, "key-a").responses.create(model="tiny", input="hello", max_output_tokens=4)
        assert (await client(serve, "key-a").responses.retrieve(stored.id)).id == stored.id
        with pytest.raises(openai.NotFoundError) as other:
            await client(serve, "key-b").responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client(serve, "key-b").responses.retrieve("resp_does_not_exist")
        with pytest.raises(openai.NotFoundError):
            await client(serve, "key-b").responses.create(model="tiny", input="more", max_output_tokens=4,
                                                          previous_response_id=stored.id)
    assert other.value.body["code"] == missing.value.body["code"]  # no oracle: the same answer as for nothing


def test_a_key_given_to_two_tenants_is_refused():
    with pytest.raises(ConfigError, match="tenants.b.keys: a key of tenant a"):
        load_config(None, ['tenants={a: {keys: ["k"]}, b: {keys: ["k"]}}'])


def test_tenants_and_serve_api_keys_are_not_mixed():
    with pytest.raises(ConfigError, match="serve.api_keys"):
        load_config(None, ['tenants={a: {keys: ["k"]}}', 'serve.api_keys=["other"]'])


def test_a_tenant_name_must_be_safe_on_the_bus():
    with pytest.raises(ConfigError, match="tenants"):
        load_config(None, ['tenants={"a b": {keys: ["k"]}}'])


def test_keys_come_from_the_environment_and_a_missing_variable_is_named(monkeypatch):
    config = load_config(None, ['tenants={acme: {keys: [{env: ACME_KEY, training: off}]}}'])
    monkeypatch.setenv("ACME_KEY", "from-env")
    grant = TenantDirectory.from_config(config).grant_of(b"from-env")
    assert (grant.tenant, grant.training, grant.store) == ("acme", "off", True)
    monkeypatch.delenv("ACME_KEY")
    with pytest.raises(ConfigError, match="tenants.acme.keys: ACME_KEY is not set"):
        TenantDirectory.from_config(config)


def test_a_key_narrows_its_tenant_and_never_widens_it():
    config = load_config(None, ['tenants={acme: {training: off, keys: [{value: k, training: opt_out}]}}'])
    assert TenantDirectory.from_config(config).grant_of(b"k").training == "off"
    with pytest.raises(ConfigError, match="by value or by env"):
        load_config(None, ['tenants={acme: {keys: [{training: off}]}}'])


async def test_a_session_opened_at_one_gateway_takes_feedback_at_another(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, KEYS) as (first, _, _), platform(nats_url, tmp_path / "second", KEYS) as (second, _, _):
        await ask(first, "key-a", "roaming", "hello")
        assert (await signal(second, "key-a", "roaming", "feedback", reward=1.0)).status_code == 200
        assert (await signal(second, "key-b", "roaming", "feedback", reward=1.0)).status_code == 404


async def test_a_session_opened_while_the_bus_is_down_is_written_once_it_is_back(nats_url, bus):
    """The gateway serves on when the bus is unreachable; the sessions it opened meanwhile are
    known to it at once and to every gateway once a write gets through."""
    from flywheel.tenants.sessions import SessionRegistry

    class Flaky:
        def __init__(self, kv):
            self.kv, self.down = kv, True

        async def put(self, key, value):
            if self.down:
                raise TimeoutError("bus unreachable")
            return await self.kv.put(key, value)

        async def get(self, key):
            return await self.kv.get(key)

    real = await SessionRegistry.open(bus, 60)
    flaky = Flaky(real._kv)
    gateway, other = SessionRegistry(flaky), SessionRegistry(real._kv)
    await gateway.opened("acme/while-down", "acme")
    assert await gateway.exists("acme/while-down") and not await other.exists("acme/while-down")
    flaky.down = False
    await gateway.opened("acme/next", "acme")
    assert await other.exists("acme/while-down") and await other.exists("acme/next")


CONSENT = ('tenants={acme: {keys: ["opt-in-key", {value: "off-key", training: off}, {value: "unkept-key", store: false}]}, '
           'open-co: {training: opt_out, keys: ["opt-out-key"]}}')


async def test_consent_is_the_strictest_of_tenant_key_and_request(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, CONSENT) as (serve, _, _):
        await ask(serve, "opt-in-key", "in-silent", "hi")
        await ask(serve, "opt-in-key", "in-asked", "hi", **{"X-Flywheel-Train": "true"})
        await ask(serve, "opt-out-key", "out-silent", "hi")
        await ask(serve, "opt-out-key", "out-declined", "hi", **{"X-Flywheel-Train": "false"})
        await ask(serve, "off-key", "off-silent", "hi")
        with pytest.raises(openai.PermissionDeniedError) as refused:  # asked where the key forbids: not a silent downgrade
            await ask(serve, "off-key", "off-asked", "hi", **{"X-Flywheel-Train": "true"})
        _, turns = await collected(bus, n_sessions=0, n_turns=5)
    consent = {session.split("/", 1)[1]: ts[0].consent for session, ts in turns.items()}
    assert consent == {"in-silent": False, "in-asked": True, "out-silent": True, "out-declined": False, "off-silent": False}
    assert refused.value.body["code"] == "training_not_permitted"


async def test_store_false_is_served_and_nothing_is_kept(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, CONSENT) as (serve, _, _):
        unkept = await client(serve, "opt-out-key").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "secret"}], max_tokens=2, store=False,
            extra_headers={"X-Session-Id": "unkept"})
        by_key = await ask(serve, "unkept-key", "unkept-by-key", "secret")
        answer = await client(serve, "unkept-key").responses.create(model="tiny", input="secret", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):  # trained but not kept: a contradiction
            await client(serve, "opt-out-key").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, store=False,
                extra_headers={"X-Session-Id": "both", "X-Flywheel-Train": "true"})
        assert unkept.choices and by_key.choices  # served
        with pytest.raises(openai.NotFoundError):
            await client(serve, "unkept-key").responses.retrieve(answer.id)
        assert (await signal(serve, "opt-out-key", "unkept", "feedback", reward=1.0)).status_code == 404
        await ask(serve, "opt-out-key", "kept", "marker")  # recorded after the others: they would come first
        _, turns = await collected(bus, n_sessions=0, n_turns=1)
    assert [session.split("/", 1)[1] for session in turns] == ["kept"]


async def test_a_tenants_records_are_gone_past_its_retention_and_anothers_stay(nats_url, tmp_path, bus):
    """`retention_days` puts a per-message age limit (`Nats-TTL`) on the tenant's records; here
    two seconds, against a tenant with the streams' own limit."""
    two_seconds = 2 / 86_400
    tenants = (f"tenants={{brief: {{training: opt_out, retention_days: {two_seconds}, keys: [k-brief]}}, "
               "long: {training: opt_out, keys: [k-long]}}")
    async with platform(nats_url, tmp_path, tenants) as (serve, _, _):
        await ask(serve, "k-brief", "short-lived", "forget me soon")
        await ask(serve, "k-long", "long-lived", "keep me")
        turns = await delivered(bus.consumer(TURN_SUBJECT, "retention-check"), 2)
    seq = {delivery.record.tenant: delivery.stream_seq for delivery in turns}

    async def gone(stream_seq: int) -> bool:
        try:
            await bus.js.get_msg("TRAFFIC", stream_seq)
        except NotFoundError:
            return True
        return False

    await until(lambda: gone(seq["brief"]), timeout_s=30)
    assert not await gone(seq["long"])


async def test_a_user_named_in_a_header_is_the_same_user_as_named_in_the_body(nats_url, tmp_path, bus):
    """Clients send header values in UTF-8 (HTTP servers read them as Latin-1): `X-User-Id: José`
    must be José, as `"user": "José"` is, one user with one adapter, forgotten under one name;
    the session header likewise."""
    async with platform(nats_url, tmp_path, KEYS) as (serve, _, _):
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer key-a"}) as http:
            chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            by_header = await http.post("/v1/chat/completions", json=chat,
                                        headers={"X-Session-Id": "café".encode(), "X-User-Id": "José".encode()})
            by_body = await http.post("/v1/chat/completions", json={**chat, "user": "José", "metadata": {"session_id": "thé"}})
            assert by_header.status_code == by_body.status_code == 200
            assert (await http.post("/v1/sessions/café/end")).status_code == 200
        turns = await recorded_turns(bus, 2)
    assert sorted(turn.user_id for turn in turns) == ["José", "José"]
    assert sorted(turn.session_id.split("/")[1] for turn in turns) == ["café", "thé"]


async def test_one_tenants_stored_responses_never_evict_anothers(nats_url, tmp_path):
    async with platform(nats_url, tmp_path, KEYS, "serve.stored_responses=2") as (serve, _, _):
        kept = await client(serve, "key-a").responses.create(model="tiny", input="hi", max_output_tokens=2)
        for _ in range(3):
            await client(serve, "key-b").responses.create(model="tiny", input="flood", max_output_tokens=2)
        async with httpx.AsyncClient(base_url=f"{serve.url}/v1", headers={"Authorization": "Bearer key-a"}) as http:
            assert (await http.get(f"/responses/{kept.id}")).status_code == 200


ADMIN = ["serve.admin_key=root", 'tenants={acme: {training: opt_out, keys: ["config-key"]}}']


async def admin(serve, method: str, path: str, key: str = "root", **body) -> httpx.Response:
    async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": f"Bearer {key}"}) as http:
        return await http.request(method, path, json=body or None)


async def test_tenants_and_keys_change_at_run_time_at_every_gateway_and_are_audited(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *ADMIN) as (first, _, _), \
            platform(nats_url, tmp_path / "second", *ADMIN) as (second, _, _):
        assert (await admin(first, "POST", "/admin/tenants", name="globex", training="opt_out")).status_code == 200
        minted = (await admin(first, "POST", "/admin/tenants/globex/keys")).json()
        assert (await ask(first, minted["key"], "g1", "hi")).choices  # at once where it was made
        await until(lambda: second.app and second.tenants.grant_of(minted["key"].encode()) is not None)
        assert (await ask(second, minted["key"], "g2", "hi")).choices  # and at the other gateway
        config_key = next(k["id"] for t in (await admin(first, "GET", "/admin/tenants")).json()["data"]
                          if t["name"] == "acme" for k in t["keys"])
        assert (await admin(second, "DELETE", f"/admin/tenants/acme/keys/{config_key}")).status_code == 200
        await until(lambda: first.tenants.grant_of(b"config-key") is None)
        with pytest.raises(openai.AuthenticationError):
            await ask(first, "config-key", "a1", "hi")  # a key of the configuration, revoked at run time
        log = (await admin(first, "GET", "/admin/audit")).json()["data"]
    assert [(e["action"], e["target"]) for e in log] == [
        ("tenant.add", "globex"), ("key.add", f"globex/{minted['id']}"), ("key.revoke", f"acme/{config_key}")]
    assert all(e["actor"] == "admin" and e["at"] > 0 for e in log)
    async with platform(nats_url, tmp_path / "third", *ADMIN) as (restarted, _, _):  # persisted on the bus
        assert (await ask(restarted, minted["key"], "g3", "hi")).choices
        with pytest.raises(openai.AuthenticationError):
            await ask(restarted, "config-key", "a2", "hi")


async def test_the_admin_api_needs_the_admin_key_and_a_client_key_never_reaches_it(nats_url, tmp_path):
    async with platform(nats_url, tmp_path, *ADMIN) as (serve, _, _):
        assert (await admin(serve, "POST", "/admin/tenants", key="config-key", name="evil")).status_code == 401
        assert (await admin(serve, "GET", "/admin/tenants", key="config-key")).status_code == 401
    async with platform(nats_url, tmp_path / "open", 'tenants={acme: {keys: ["k"]}}') as (serve, _, _):
        refused = await admin(serve, "POST", "/admin/tenants", key="k", name="evil")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"


async def test_a_tenant_that_exists_or_does_not_is_told_so(nats_url, tmp_path):
    async with platform(nats_url, tmp_path, *ADMIN) as (serve, _, _):
        assert (await admin(serve, "POST", "/admin/tenants", name="acme")).status_code == 409
        assert (await admin(serve, "POST", "/admin/tenants/nobody/keys")).status_code == 404
        assert (await admin(serve, "DELETE", "/admin/tenants/acme/keys/000000000000")).status_code == 404
        assert (await admin(serve, "POST", "/admin/tenants", name="Not Safe")).status_code == 400
        # `shared` is the deployment's own adapter: a tenant so named would train and delete it
        reserved = await admin(serve, "POST", "/admin/tenants", name="shared")
        assert reserved.status_code == 400 and "reserved" in reserved.json()["error"]["message"]


PII = ('tenants={dropping: {training: opt_out, pii: drop, keys: [k-drop]}, '
       'redacting: {training: opt_out, pii: redact_input, keys: [k-redact]}, '
       'trusting: {training: opt_out, pii: "off", keys: [k-off]}}')


async def test_personal_data_is_dropped_or_redacted_before_anything_is_kept(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, PII) as (serve, _, _):
        email = "Write to ada.lovelace@gmail.com about my card 4111 1111 1111 1111."
        served = [await ask(serve, "k-drop", "d-pii", email), await ask(serve, "k-drop", "d-clean", "What is 2 + 3?"),
                  await ask(serve, "k-redact", "r-pii", email), await ask(serve, "k-off", "o-pii", email)]
        _, turns = await collected(bus, n_sessions=0, n_turns=3)
        dropped = dict(serve.app.state.personal_data.dropped)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{serve.url}/metrics")).text
    assert all(reply.choices for reply in served)  # every request was served
    recorded = {session.split("/", 1)[1]: ts[0] for session, ts in turns.items()}
    assert set(recorded) == {"d-clean", "r-pii", "o-pii"} and dropped == {"dropping": 1}
    redacted = recorded["r-pii"]
    assert redacted.messages[-1]["content"] == "Write to <EMAIL_ADDRESS> about my card <CREDIT_CARD>."
    # The recorded tokens are the redacted prompt's: exactly what the model saw and sampled from.
    tokenizer = serve.engine.tokenizer
    seen = tokenizer.decode(redacted.prompt_ids)
    assert "<EMAIL_ADDRESS>" in seen and "gmail" not in seen and "4111" not in seen
    assert recorded["o-pii"].messages[-1]["content"] == email  # `off`: kept as sent
    # What each tenant did, by its label: its requests, its turns dropped, its prompts redacted.
    assert 'flywheel_pii_dropped_turns_total{tenant="dropping"} 1.0' in metrics
    assert 'flywheel_pii_redacted_requests_total{tenant="redacting"} 1.0' in metrics
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="200",tenant="dropping"} 2.0' in metrics


async def test_personal_data_split_across_content_parts_is_found_in_its_part(nats_url, tmp_path, bus):
    """Each text part is read on its own: joined, a card number's part and a next part that begins
    with a digit ("...1111" + "2 ...") read as no card at all, and `drop` kept the turn."""
    parts = [{"type": "text", "text": "My card is 4111 1111 1111 1111"}, {"type": "text", "text": "2 thanks"}]
    async with platform(nats_url, tmp_path, PII) as (serve, _, _):
        await client(serve, "k-drop").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4, extra_headers={"X-Session-Id": "parts"})
        await ask(serve, "k-drop", "clean", "What is 2 + 3?")
        _, turns = await collected(bus, n_sessions=0, n_turns=1)
        assert dict(serve.app.state.personal_data.dropped) == {"dropping": 1}
    assert [session.split("/", 1)[1] for session in turns] == ["clean"]


async def test_a_large_records_body_goes_with_its_message_past_the_tenants_retention(nats_url, tmp_path, bus):
    """A record over the message size keeps its body in the object store, which has no
    per-object age: it is written with the tenant's expiry and the collector deletes it."""
    brief = await Bus.connect(nats_url, name="brief", retention={"brief": 1})
    try:
        large = "x" * (brief.nc.max_payload + 1)
        await brief.publish(TURN_SUBJECT, make_turn(id="big", tenant="brief", messages=[{"role": "user", "content": large}]))
        await brief.publish(TURN_SUBJECT, make_turn(id="kept", tenant="long", messages=[{"role": "user", "content": large}]))
    finally:
        await brief.close()
    name = f"{TURN_SUBJECT}/big"
    assert await bus.large.get(name)

    async def gone() -> bool:
        try:
            await bus.large.get(name)
        except NotFoundError:
            return True
        return False

    async def expired() -> bool:  # the message went with its Nats-TTL: the body's expiry has passed too
        return (await bus.js.stream_info("TRAFFIC")).state.messages == 1

    await until(expired, timeout_s=30)
    assert not await gone()
    collect = CollectLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await collect.start()  # sweeps at once, then every minute
    try:
        await until(gone)
    finally:
        await collect.stop()
    assert await bus.large.get(f"{TURN_SUBJECT}/kept")
