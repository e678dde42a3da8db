"""A real vLLM server behind the gateway (`serve.engine_kind: vllm`): the contract the embedded
engine meets, met through vLLM's token-in/token-out and RL endpoints with the official openai
client. One vLLM server (the CPU build in `.venv-vllm`, float32, the `tiny` model) is started by
the serve loop itself for the whole module (it costs ~30-60 s) and stopped with it.

Exact tokens and log-probs recorded (what vLLM sampled, byte for byte), an exact multi-turn
continuation, n > 1, stop strings, response formats, the trainer's `behav_logprob_gap` over
vLLM's log-probs (printed, and bounded), and hot swaps under load with no failed request,
monotone versions and, for swaps that recompute, each token's log-prob that of its version."""

import asyncio
import os
import time
import uuid

import httpx
import openai
import psutil
import pytest
import torch
from transformers import AutoTokenizer

from flywheel.bus import (
    TRAFFIC_SUBJECTS,
    TRAJECTORY_SUBJECT,
    WEIGHTS_SUBJECT,
    Bus,
    EmbeddedNats,
    Sample,
    Trajectory,
    Turn,
    WeightUpdate,
)
from flywheel.collect.loop import CollectLoop
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model, load_weights, resolve_model
from flywheel.serve.backends import vllm_server
from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.vllm import VLLMEngineClient
from flywheel.serve.loop import ServeLoop
from flywheel.train.trainer import Trainer

from bus_reading import delivered
from factories import (
    FORECAST,
    assert_prompts_render_the_conversation,
    assert_segment_is_exact,
    one_vllm_server,
    post_feedback,
    recomputed_logprobs,
    step_of,
)
from waiting import until

pytestmark = pytest.mark.timeout(600)
TOL = 5e-4  # vLLM's decode step against a full forward pass of the same float32 weights


class Platform:
    """The bus, serve (starting its own vLLM server) and collect, for the whole module."""

    async def start(self, run_dir) -> "Platform":
        self.nats = EmbeddedNats(run_dir / "nats")
        self.nats.start()
        self.config = load_config(None, [f"run_dir={run_dir}", "serve.port=0", "serve.engine_kind=vllm", "serve.max_batch_size=32",
                                         "serve.swap_mode=retract", "collect.feedback_grace_s=0", "serve.max_new_tokens=4096"])
        started = time.monotonic()
        self.serve = ServeLoop(self.config, self.nats.url)
        await self.serve.start()
        self.start_s = time.monotonic() - started
        self.collect = CollectLoop(self.config, self.nats.url)
        await self.collect.start()
        self.bus = await Bus.connect(self.nats.url, name="test")
        self.client = openai.AsyncOpenAI(base_url=f"{self.serve.url}/v1", api_key="x", max_retries=0, timeout=120)
        self.stopped = False
        return self

    @property
    def vllm(self) -> VLLMEngineClient:
        [engine] = self.serve.pool.engines
        return engine

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.collect.stop()
            await self.serve.stop()
            await self.bus.close()
        self.nats.stop()

    async def records(self, subject, kind: type, match, n: int, timeout_s: float = 60) -> list:
        """The first `n` records of `kind` on `subject` that `match`, read from the start."""
        consumer = self.bus.consumer(subject, f"check-{uuid.uuid4().hex[:8]}")
        return [d.record for d in await delivered(consumer, n, lambda r: isinstance(r, kind) and match(r), timeout_s)]

    async def turns(self, *sessions: str) -> dict[str, list[Turn]]:
        turns = await self.records(TRAFFIC_SUBJECTS, Turn, lambda t: t.session_id.split("/")[0] in sessions, len(sessions))
        by_session: dict[str, list[Turn]] = {}
        for turn in turns:
            by_session.setdefault(turn.session_id, []).append(turn)
        return by_session


@pytest.fixture(scope="module")
async def platform(tmp_path_factory):
    if not os.path.exists(os.environ.get("FLYWHEEL_VLLM_PYTHON") or vllm_server.VENV_PYTHON):
        pytest.fail("vLLM is not installed: run `make vllm-venv` (make test does)")
    async with one_vllm_server():
        running = await Platform().start(tmp_path_factory.mktemp("vllm"))
        print(f"\nthe gateway and its vLLM server started in {running.start_s:.1f}s")
        yield running
        await running.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def chat_ids(tokenizer, messages) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


async def test_turns_record_exactly_what_vllm_sampled(platform, tokenizer):
    messages = [{"role": "user", "content": "Write some digits."}]
    kw = dict(model="tiny", messages=messages, max_tokens=16, temperature=0.8, seed=7, logprobs=True, top_logprobs=3)
    reply = await platform.client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "whole"})
    stream = await platform.client.chat.completions.create(**kw, stream=True, extra_headers={"X-Session-Id": "streamed"})
    chunks = [chunk async for chunk in stream]
    turns = await platform.turns("whole", "streamed")
    [whole], [streamed] = turns["whole"], turns["streamed"]
    content = reply.choices[0].logprobs.content
    assert reply.system_fingerprint == "flywheel-v0" and all(c.system_fingerprint == "flywheel-v0" for c in chunks[1:])
    assert whole.prompt_ids == streamed.prompt_ids == chat_ids(tokenizer, messages)
    assert tokenizer.decode(whole.output_ids, skip_special_tokens=True) == reply.choices[0].message.content
    assert [e.logprob for e in content] == whole.output_logprobs and whole.output_versions == [0] * len(whole.output_ids)
    for entry in content:  # vLLM lists the sampled token first: the client keeps the 3 most likely
        assert len(entry.top_logprobs) == 3 and [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob <= entry.top_logprobs[0].logprob
    # Streamed with the same seed: the same tokens, each chunk's text and log-probs as recorded.
    assert streamed.output_ids == whole.output_ids and streamed.output_logprobs == pytest.approx(whole.output_logprobs, abs=1e-6)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # What vLLM itself samples for these ids and this seed is what was recorded.
    async with httpx.AsyncClient(base_url=platform.vllm.name) as http:
        direct = (await http.post("/inference/v1/generate", json={"token_ids": list(whole.prompt_ids), "sampling_params": {
            "max_tokens": 16, "temperature": 0.8, "seed": 7, "logprobs": 0}})).json()["choices"][0]
    assert direct["token_ids"] == whole.output_ids
    assert [e["logprob"] for e in direct["logprobs"]["content"]] == pytest.approx(whole.output_logprobs, abs=1e-6)
    # vLLM's tempered log-probs are the float32 model's (the trainer's recomputation).
    model, _ = load_model("tiny")
    expected = recomputed_logprobs(model, whole.prompt_ids, whole.output_ids, temperature=0.8)
    assert whole.output_logprobs == pytest.approx(expected, abs=TOL)


async def test_n_choices_and_stop_strings(platform, tokenizer):
    base = dict(model="tiny", messages=[{"role": "user", "content": "Write some digits."}], max_tokens=8)
    reply = await platform.client.chat.completions.create(**base, n=3, seed=1, extra_headers={"X-Session-Id": "multi"})
    stream = await platform.client.chat.completions.create(**base, n=2, seed=5, stream=True, extra_headers={"X-Session-Id": "multi-s"})
    streamed = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    stops = [" ", "e", "a", "o"]
    stopped = await asyncio.gather(*(platform.client.chat.completions.create(
        **base | {"max_tokens": 16}, seed=i, stop=stops, extra_headers={"X-Session-Id": f"stop{i}"}) for i in range(3)))
    turns = await platform.turns("multi", "multi-s", "stop0", "stop1", "stop2")
    assert len({t[0].task_id for s, t in turns.items() if s.startswith("multi/")}) == 1
    for choice in reply.choices:
        [turn] = turns[f"multi/{choice.index}"]
        assert tokenizer.decode(turn.output_ids, skip_special_tokens=True) == choice.message.content
    assert len({tuple(turns[f"multi/{i}"][0].output_ids) for i in range(3)}) == 3  # seed + index each
    for i, text in streamed.items():
        assert tokenizer.decode(turns[f"multi-s/{i}"][0].output_ids, skip_special_tokens=True) == text
    for i, answer in enumerate(stopped):  # text before the stop string; ids to the token that completed it
        [turn] = turns[f"stop{i}"]
        output, content = tokenizer.decode(turn.output_ids), answer.choices[0].message.content
        assert turn.finish_reason == "stop" and any(s in output for s in stops) and not any(s in content for s in stops)
        assert output.startswith(content) and not any(s in tokenizer.decode(turn.output_ids[:-1]) for s in stops)


async def test_aborts_and_bad_requests_are_clear(platform):
    """`abort` ends a running request with what it sampled so far; what vLLM cannot do is a 400
    naming it; weights that are not there, or an RPC the workers lack, are errors, and the
    server goes on (on a new connection: vLLM drops the one an endpoint failed on)."""
    client = platform.vllm
    budget = 60_000  # a minute of tiny's tokens: the abort lands first on a busy machine too (2,000 once did not)
    body = {"input_ids": [5, 6, 7], "rid": "abort-me", "return_logprob": True,
            "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
    chunks = []
    async for chunk in client.generate_stream(body):
        chunks.append(chunk)
        if len(chunks) == 2:
            await client.abort("abort-me")
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort" and sum(len(c["output_ids"]) for c in chunks) < budget
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in chunks)
    for params, named in (({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty"),
                          ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(EngineError, match=named) as error:
            await client.generate({"input_ids": [5], "sampling_params": params})
        assert error.value.status == 400
    with pytest.raises(EngineError, match="no .safetensors weights in /nonexistent"):
        await client.update_weights_from_disk("/nonexistent", client.weight_version + 1)
    with pytest.raises(EngineError):
        await client._call("POST", "/collective_rpc", {"method": "no_such_method"})
    reply = await client.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert len(reply["output_ids"]) == 3 and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_canary_engine_urls_get_the_serving_engine_kind(platform):
    """Under promotion, `promotion.canary.engine_urls` are clients of `serve.engine_kind`: vLLM's here."""
    config = load_config(None, ["serve.engine_kind=vllm", f"promotion.canary.engine_urls=[{platform.vllm.name}]"])
    [canary] = await ServeLoop(config, platform.nats.url)._canary_engines()
    try:
        assert isinstance(canary, VLLMEngineClient) and canary.weight_version == platform.vllm.weight_version
        assert canary.context_length == platform.vllm.context_length
    finally:
        await canary.close()


SHAPED = {"response_format": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}}


async def test_multi_turn_sessions_are_exact_and_the_trainer_reproduces_vllms_logprobs(platform, tokenizer):
    """Agents' sessions (the whole history each turn, at temperature 1, 0.7 and under a JSON
    schema) become one exact segment each; one step of the real trainer over them recomputes
    vLLM's behaviour log-probs (`behav_logprob_gap`, printed)."""
    async def agent(session: str, reward: float, texts: list[str], **kw) -> None:
        messages: list[dict] = []
        for i, text in enumerate(texts):
            messages.append({"role": "user", "content": text})
            reply = await platform.client.chat.completions.create(model="tiny", messages=messages, seed=i,
                                                                  extra_headers={"X-Session-Id": session}, **{"max_tokens": 12, **kw})
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        await post_feedback(platform.serve, session, reward)

    sessions = {"warm": dict(temperature=1.0), "cool": dict(temperature=0.7), "shaped": dict(max_tokens=40, **SHAPED)}
    texts = ["Count to three.", "Now backwards.", "Thanks!"]
    await asyncio.gather(*(agent(name, float(i), texts, **kw) for i, (name, kw) in enumerate(sessions.items())))
    trajectories = await platform.records(TRAJECTORY_SUBJECT, Trajectory, lambda t: t.session_id in sessions, len(sessions))
    turns = await platform.records(TRAFFIC_SUBJECTS, Turn, lambda t: t.session_id in sessions, 3 * len(sessions))
    for trajectory in trajectories:
        session_turns = sorted((t for t in turns if t.session_id == trajectory.session_id), key=lambda t: t.turn_index)
        [segment] = trajectory.segments
        assert_segment_is_exact(segment, session_turns)
        assert_prompts_render_the_conversation(tokenizer, session_turns)
    assert all("json_schema" in t.sampling for t in turns if t.session_id == "shaped")

    config = load_config(None, ["actor.ppo_n_minibatches=1"])
    samples = [Sample(id=t.id, trajectory=t, reward=float(i), judge="rule") for i, t in enumerate(trajectories)]
    batch = step_of(samples, config)
    metrics = Trainer(load_model("tiny")[0], config.actor, config.train).step(batch.minibatches, version=0)
    sampled = sum(sum(seg.loss_mask) for t in trajectories for seg in t.segments)
    print(f"\nbehav_logprob_gap against vLLM: mean {metrics['behav_logprob_gap']:.2e}, "
          f"max {metrics['behav_logprob_gap_max']:.2e} over {metrics['gap_tokens']} tokens")
    assert not batch.excluded and metrics["gap_tokens"] == sampled and metrics["grammar_tokens"] > 0
    assert metrics["behav_logprob_gap"] < 1e-4 and metrics["behav_logprob_gap_max"] < TOL


STREAMS, WHOLE = 2, 4
"""Clients streaming their answers and clients taking them whole, as load across the swaps."""
MODES = ("in_place", "retract")
SWAPS_PER_MODE = 5
"""Each mode swaps until its probe crossed a swap, at most 5 times. A probe misses when the
tokens that set off its swap reach this process only after vLLM is done with it: it did, often,
while vLLM's CPU build ran pinned to one core and starved other processes for seconds (now
unpinned, `test_vllm_may_run_on_every_core`); since then every probe crossed at its first swap."""
LENGTHS = {"stream": 48, "whole": 384, "probe": 1024}
"""Tokens per answer. A probe is long: the swap meant for it must reach the engine while it is
still decoding (under this load, ~10 s of decoding left once its first tokens are here)."""


async def test_hot_swaps_under_load_fail_nothing_and_label_every_token(platform, tmp_path):
    """Streaming and whole-answer clients while versions roll in (in place, then recomputing):
    no request fails, versions only grow; a whole answer carries vLLM's exact spans, so where the
    swap recomputed, each token's log-prob is its version's weights' on its prefix. For each
    swap a probe (a long stream) is sent, and the swap is published once the probe has received
    tokens, which it crosses unless those tokens reached this process only after vLLM was done
    with it (whole answers chosen by the streams' progress missed 6 swaps in a row while vLLM,
    pinned, starved this process for seconds). Its tokens labelled with the new
    version are exact (a stream's earlier tokens may be labelled older, never newer), so under a
    recomputing swap they are checked against that version's weights. Swaps in place keep the
    running requests' KV (vLLM's pause drops it unless told not to: an 8 s stall on SmolLM2);
    each swap that recomputes resets it once."""
    serve = platform.serve
    store = WeightStore(tmp_path / "store", keep=2 * SWAPS_PER_MODE + 2)
    model, _ = load_model("tiny")
    store.publish(model, 0)
    modes: dict[int, str] = {}  # each version's swap mode
    crossed = {mode: 0 for mode in MODES}  # probes that went on across a swap of each mode
    done = asyncio.Event()
    tokens = [0]  # every answer's tokens, as the clients receive them
    received: dict[str, int] = {}  # each stream's tokens so far
    resets = {}  # vLLM's KV cache resets before the first swap, and before the first recomputing one
    completed, failures, fingerprints, whole = [], [], {}, set()

    async def answer(client, session: str, kind: str) -> None:
        """One request of `kind` (stream, whole or probe), its tokens counted as they come."""
        kw = dict(model="tiny", messages=[{"role": "user", "content": f"Tell me a number, {session}."}],
                  max_tokens=LENGTHS[kind], extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": session})
        try:
            if kind == "whole":
                whole.add(session)
                reply = await client.chat.completions.create(**kw)
                tokens[0] += reply.usage.completion_tokens
                fingerprints[session] = [int(reply.system_fingerprint.removeprefix("flywheel-v"))]
            else:
                chunks = []
                async for chunk in await client.chat.completions.create(**kw, stream=True, logprobs=True):
                    chunks.append(chunk)
                    sampled = len(chunk.choices[0].logprobs.content) if chunk.choices and chunk.choices[0].logprobs else 0
                    tokens[0] += sampled
                    received[session] = received.get(session, 0) + sampled
                fingerprints[session] = [int(c.system_fingerprint.removeprefix("flywheel-v")) for c in chunks[1:]]
                assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
            completed.append(session)
        except Exception as exc:  # any failure at all is a finding
            failures.append((session, repr(exc)))

    async def user(i: int) -> None:
        client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0, timeout=120)
        for k in range(1000):
            if done.is_set():
                return
            await answer(client, f"swap{i}-{k}", "stream" if i < STREAMS else "whole")

    async def swap(version: int, mode: str) -> str:
        """One swap to `version` while a probe (a long stream) is decoding; the probe's session.
        The tokens it received were sampled: once it has some, the swap is published, and the
        probe has ~1,000 steps to go, more than the swap takes to reach the engine."""
        seen = tokens[0]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        path = await asyncio.to_thread(store.publish, model, version)
        await until(lambda: tokens[0] >= seen + 24 * STREAMS)  # let traffic flow between swaps
        session = f"probe{version}"
        probe = asyncio.create_task(answer(openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0, timeout=300),
                                           session, "probe"))
        await until(lambda: received.get(session, 0) >= 2 or probe.done(), poll_s=0.005)
        resets.setdefault(mode, cache_resets(serve.vllm_server))
        modes[version] = serve.config.serve.swap_mode = mode
        # The claim is the swap's, not the bus's speed: in a fresh clone's suite (two cores, three
        # workers, vLLM here) JetStream's ack of this announcement took more than the default 10 s.
        await platform.bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"w{version}", version=version, path=str(path), step=version),
                                   timeout_s=120)
        await until(lambda: serve.stats()["swaps"] >= version)
        await probe
        return session

    async def swapper() -> None:
        version = 0
        for mode in MODES:
            for _ in range(SWAPS_PER_MODE):
                version += 1
                session = await swap(version, mode)
                [turn] = await platform.records(TRAFFIC_SUBJECTS, Turn, lambda t: t.session_id == session, 1)
                if version in turn.output_versions and turn.output_versions[0] < version:
                    crossed[mode] += 1
                    break
        done.set()

    await asyncio.wait_for(asyncio.gather(swapper(), *(user(i) for i in range(STREAMS + WHOLE))), 400)
    swaps = len(modes)
    assert failures == [] and serve.stats()["swaps"] == swaps and platform.vllm.weight_version == swaps
    recomputing = sum(mode == "retract" for mode in modes.values())
    assert resets["retract"] - resets["in_place"] == 0 and cache_resets(serve.vllm_server) - resets["retract"] == recomputing
    print(f"\n{len(completed)} requests across {swaps} swaps ({modes}), probes crossed {crossed}; "
          f"pauses {[round(p, 3) for p in serve.pauses]} s")
    assert all(crossed.values()), crossed  # a probe was decoding across a swap of each mode and went on
    recorded = {t.session_id: t for t in await platform.records(TRAFFIC_SUBJECTS, Turn, lambda t: t.session_id.startswith(("swap", "probe")),
                                                                   len(completed))}
    checker, _ = load_model("tiny")
    for session, turn in recorded.items():
        versions = turn.output_versions
        kind = "probe" if session.startswith("probe") else "whole" if session in whole else "stream"
        assert versions == sorted(versions) and set(versions) <= set(range(swaps + 1)), session
        assert turn.finish_reason == "length" and len(versions) == LENGTHS[kind]
        assert fingerprints[session] == sorted(fingerprints[session]) and fingerprints[session][-1] == versions[-1]
        if len(set(versions)) > 1 and kind != "stream":  # a whole answer or probe that crossed a swap
            for version in sorted(set(versions))[1:]:
                if modes[version] != "retract":
                    continue  # in place: later tokens of a running request see KV of the older weights
                load_weights(checker, store.path(version))
                idx = [j for j, v in enumerate(versions) if v == version]
                start, end = idx[0], idx[-1] + 1
                expected = recomputed_logprobs(checker, turn.prompt_ids + turn.output_ids[:start], turn.output_ids[start:end])
                assert turn.output_logprobs[start:end] == pytest.approx(expected, abs=TOL), (session, version)


def cache_resets(server: vllm_server.VLLMServer) -> int:
    """How many times vLLM dropped its KV cache, the running requests' with it (they are then
    recomputed), as its log says: written before the call that did it returns. (Its preemption
    metric is no witness: it counts these only when the request's next output is not dropped.)"""
    return server.log_path.read_text(errors="replace").count("Successfully reset prefix cache")


def test_vllm_may_run_on_every_core(platform):
    """None of vLLM's processes is pinned to some of the cores. Its CPU build's default pins the
    model's worker to one core; with the worker and the engine core busy-waiting between steps,
    the kernel then left other processes runnable but unscheduled for seconds (a bystander that
    sleeps 10 ms at a time waited 15 s of 20): the gateway, its clients, and vLLM's own HTTP
    server (`docs/benchmarks.md`, odd things 5)."""
    everywhere = os.sched_getaffinity(0)
    server = psutil.Process(platform.serve.vllm_server.pid)
    members = [server, *server.children(recursive=True)]
    assert len(members) >= 3  # its HTTP server, engine core and worker
    assert {p.pid: set(p.cpu_affinity()) for p in members} == {p.pid: everywhere for p in members}


async def test_stopping_the_gateway_stops_its_vllm_server(platform):
    server = platform.serve.vllm_server
    pid = server.pid
    assert pid is not None and (await platform.vllm.refresh_version()) == platform.vllm.weight_version
    await platform.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # its whole process group (the engine core too) is gone
