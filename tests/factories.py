"""What tests build and read the same way: plain functions and classes, no fixtures (those are in
`conftest.py`, which builds them from here).

- Records: `make_turn`, `conversation` (a trajectory of assistant replies), `fb` (feedback),
  real engine samples (`sampled_turns`) and what the trainer takes of them (`sample_of`,
  `rows_of`, `step_of`).
- Reading the bus: in `bus_reading.py`.
- Running parts: `open_session`, `platform` (a serve loop and a collector), `teach_tiny` and `serving` (a `tiny`
  taught one answer, served), `post_feedback`, `make_engine`, `RunningApp` (an ASGI app on a free
  port), `freeze` (SIGSTOP a process).
- Engines: `prompt`, `recomputed_logprobs`.
- Promotion: `announce` (a version, noised or not), `state_of`, `is_in_state`.
- Checks: `assert_segment_is_exact`, `assert_prompts_render_the_conversation`,
  `assert_openai_error`, `assert_api_error`, `assert_same_parameters`.
- Request shapes several tests send: the weather tool (`WEATHER`, `ASK_WEATHER`, `WEATHER_CALL`)
  and the bounded forecast schema (`FORECAST`, `FORECAST_TOOLS`, `ASK_FORECAST`).
- vLLM: `one_vllm_server` (the test workers take turns running one).
Elsewhere: PEFT adapters in `peft_adapters.py`, the engine's adapter tests' in
`engine_adapters.py`, tenants' traffic in `tenant_traffic.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats.errors
import openai
import psutil
import torch

from flywheel.bus import (
    WEIGHTS_SUBJECT,
    Sample,
    SessionEvent,
    Trajectory,
    Turn,
    WeightUpdate,
)
from flywheel.bus.stitch import stitch
from flywheel.collect.loop import CollectLoop
from flywheel.config import load_config
from flywheel.drills.noised_weights import publish_noised
from flywheel.models import WeightStore, load_model, load_weights, resolve_model, save_model
from flywheel.models.cache import cached_build
from flywheel.serve.engine import Engine, SamplingParams
from flywheel.serve.loop import ServeLoop
from flywheel.train.advantages import RunningBaseline
from flywheel.train.grouping import Group, Member
from flywheel.train.packing import Row
from flywheel.train.step_batch import StepBatch
from flywheel.versions.registry import Registry

from waiting import until, until_sync

# -- request shapes --------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK_WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
"""What `teach_tiny(ASK_WEATHER, [WEATHER], WEATHER_CALL)` teaches the model to answer."""

FORECAST = {"type": "object", "additionalProperties": False, "required": ["unit", "days"],
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
"""A schema whose every value is bounded, so that even a random model must finish it."""
FORECAST_TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather forecast", "parameters": FORECAST}},
                  {"type": "function", "function": {"name": "alarm", "parameters": {
                      "type": "object", "additionalProperties": False, "required": ["on"], "properties": {"on": {"type": "boolean"}}}}}]
ASK_FORECAST = [{"role": "user", "content": "Forecast for Paris?"}]

# -- records ---------------------------------------------------------------------------------------


def make_turn(**overrides) -> Turn:
    """A small valid turn, consented for training; `overrides` replace its fields."""
    fields = dict(
        id="t1", session_id="s1", turn_index=0, model="tiny", consent=True,
        messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"},
        prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.1, -0.2], output_versions=[3, 4],
        finish_reason="stop",
    )
    fields.update(overrides)
    return Turn(**fields)


def conversation(tid: str, replies: list[str], task_id: str | None = None, feedback=(), system: str = "Be exact.") -> Trajectory:
    """A trajectory of len(replies) assistant turns; the user answers each reply but the last."""
    turns, history = [], [{"role": "system", "content": system}, {"role": "user", "content": f"task {tid}"}]
    for i, reply in enumerate(replies):
        response = {"role": "assistant", "content": reply}
        turns.append(make_turn(id=f"{tid}-{i}", session_id=tid, turn_index=i, task_id=task_id, messages=list(history), response=response))
        history += [response, {"role": "user", "content": f"user reply {i}"}]
    next_states = [[{"role": "user", "content": f"user reply {i}"}] for i in range(len(replies) - 1)] + [[]]
    return Trajectory(id=tid, session_id=tid, task_id=task_id, segments=[], turns=turns, next_states=next_states,
                      feedback=list(feedback), close_reason="done", consent=True)


def fb(reward, turn_index=None, source="env") -> SessionEvent:
    """A feedback event with `reward` (on the turn `turn_index`, or the session's)."""
    return SessionEvent(id=f"f{reward}{turn_index}", session_id="s", kind="feedback", reward=reward, turn_index=turn_index, source=source)


async def sampled_turns(n: int, version: int = 0, task_id: str | None = None, temperature: float = 1.0) -> list[Turn]:
    """Real engine samples from the tiny model, as the gateway would record them (without a
    task id, each is a group of its own)."""
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer).start()
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Write some digits."}], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = [SamplingParams(max_new_tokens=8, sampling_seed=i, temperature=temperature) for i in range(n)]
        results = await asyncio.gather(*(engine.generate(ids, p) for p in params))
    finally:
        engine.stop()
    return [
        make_turn(id=f"t{i}", session_id=f"s{i}", prompt_ids=r.prompt_ids, output_ids=r.output_ids,
                  output_logprobs=r.logprobs, output_versions=[version] * len(r.output_ids), task_id=task_id,
                  sampling={"temperature": temperature, "max_new_tokens": 8, "sampling_seed": i})
        for i, r in enumerate(results)
    ]


def sample_of(turn: Turn, reward: float, version: int | None = None) -> Sample:
    """The sample of a one-turn trajectory (its tokens relabelled as sampled by `version`, if given)."""
    if version is not None:
        turn = msgspec.structs.replace(turn, output_versions=[version] * len(turn.output_ids))
    traj = Trajectory(id=turn.session_id, session_id=turn.session_id, task_id=turn.task_id, group_size=turn.group_size,
                      segments=stitch([turn]), turns=[turn], close_reason="feedback", consent=True)
    return Sample(id=f"{turn.session_id}-{version}", trajectory=traj, reward=reward, judge="rule", consent=True)


def rows_of(samples: list[Sample], advantages: list[float]) -> list[Row]:
    """The trainer's rows of the samples' segments, each token's advantage its sample's."""
    return [Row(seg, [a * m for m in seg.loss_mask]) for s, a in zip(samples, advantages) for seg in s.trajectory.segments]


def step_of(samples: list[Sample], config) -> StepBatch:
    """One step's batch of the samples, each a group of its own."""
    groups = [Group(s.id, 1, 0.0, 0.0, {s.id: Member(s, [])}) for s in samples]
    return StepBatch(groups, config, RunningBaseline(), pad_id=0)


async def open_session(url: str, session_id: str, **headers: str) -> None:
    """Open `session_id` at the gateway at `url` with a one-token request (feedback and ends name
    a session that exists)."""
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        opened = await http.post("/v1/chat/completions", headers={"X-Session-Id": session_id}, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        opened.raise_for_status()


# -- running parts ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def platform(nats_url: str, tmp_path: Path, *overrides: str):
    """A serve loop and a collector (no feedback grace) on the bus: (serve, collect, an async openai client)."""
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "collect.feedback_grace_s=0", *overrides])
    serve, collect = ServeLoop(config, nats_url), CollectLoop(config, nats_url)
    await serve.start()
    await collect.start()
    try:
        yield serve, collect, openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0)
    finally:
        await collect.stop()
        await serve.stop()


async def post_feedback(serve, session: str, reward: float) -> None:
    """A session's reward, sent to the gateway."""
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{serve.url}/v1/sessions/{session}/feedback", json={"reward": reward})
        response.raise_for_status()


def teach_tiny(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, answer: str,
               chat_template: str | None = None) -> str:
    """Train `tiny` by a few supervised steps until it answers `messages` (rendered with `tools`)
    with `answer` and its end token, for tests that need a model that reliably produces something
    specific (a tool call, parallel calls); returns the saved model's directory (its tokenizer
    carries `chat_template` if given). Trained once per machine (the model cache, under a digest of
    what it is taught, this code, the tiny model it starts from, torch's and transformers' versions):
    several test files share one."""
    lesson = json.dumps([messages, tools, answer, chat_template, inspect.getsource(teach_tiny), str(resolve_model("tiny")),
                         *map(importlib.metadata.version, ("torch", "transformers"))])

    def build(directory: Path) -> None:
        model, tokenizer = load_model("tiny")
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
        target = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        ids = torch.tensor([prompt_ids + target])
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(150):
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(target))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert loss.item() < 0.05
        save_model(model.eval(), tokenizer, directory / "model")

    return str(cached_build(f"taught/tiny-{hashlib.sha256(lesson.encode()).hexdigest()[:24]}", build) / "model")


@contextlib.asynccontextmanager
async def serving(model: str, name: str, nats_url: str, run_dir: Path, *overrides: str) -> AsyncIterator[ServeLoop]:
    """A running serve loop for `model` (a path from `teach_tiny`), served as `name`."""
    loop = ServeLoop(load_config(None, [f"run_dir={run_dir}", "serve.port=0", f"model={model}",
                                        f"serve.served_model_name={name}", *overrides]), nats_url)
    await loop.start()
    try:
        yield loop
    finally:
        await loop.stop()


def make_engine() -> Engine:
    """A started embedded engine on the tiny model that takes weight updates."""
    model, tokenizer = load_model("tiny")
    return Engine(model, tokenizer, max_batch_size=8, load_weights=load_weights).start()


class RunningApp:
    """An ASGI app served by uvicorn on a free loopback port, in the test's event loop."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))

    async def __aenter__(self) -> str:
        self.task = asyncio.create_task(self.server.serve())
        await until(lambda: self.server.started or self.task.done(), timeout_s=60)
        if not self.server.started:
            self.task.result()  # raises what stopped it
            raise RuntimeError("uvicorn returned without starting")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.task


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once it has stopped. `kill` returns before the signal takes effect:
    under load the process went on for a moment and, in the bus drill, acknowledged a publish it
    was meant never to read (the test then waited for an in-flight publish that had ended)."""
    os.kill(pid, signal.SIGSTOP)
    process = psutil.Process(pid)
    until_sync(lambda: process.status() == psutil.STATUS_STOPPED, timeout_s, poll_s=0.001)


# -- engines ---------------------------------------------------------------------------------------


def prompt(tokenizer, text: str) -> list[int]:
    """The ids of a one-message chat asking `text`, with the generation prompt."""
    return chat_prompt(tokenizer, [{"role": "user", "content": text}])


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of the chat `messages` rendered by the tokenizer's template, with the generation prompt."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)


def recomputed_logprobs(model, prompt_ids, output_ids, temperature=1.0) -> list[float]:
    """The log-probabilities of `output_ids` after `prompt_ids` by one full forward pass of `model`."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1).tolist()


# -- promotion -------------------------------------------------------------------------------------


async def announce(bus, store: WeightStore, version: int, parent: int, noise: float = 0.0) -> None:
    """Publish `version` (`tiny`'s weights with Gaussian noise of standard deviation `noise`: 0 is
    the starting weights again) and announce it as the trainer does."""
    path = publish_noised(store, version, noise)
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"w{version}", version=version, path=path, step=version, parent=parent,
                                                    metrics={"reward_mean": 0.5}, trained_on={"samples": 8}))


async def state_of(registry: Registry, version: int) -> str | None:
    """The version's state in the registry; None if it has no entry, or if JetStream did not answer
    the read in its 5 s (a poll asks again: a suite run beside a benchmark on 2 cores failed so)."""
    try:
        entry = await registry.get(version)
    except nats.errors.TimeoutError:
        return None
    return entry and entry.state


async def is_in_state(registry: Registry, version: int, *states: str) -> bool:
    """Whether the version's state is one of `states`."""
    return await state_of(registry, version) in states


# -- checks ----------------------------------------------------------------------------------------


def assert_segment_is_exact(segment, turns: list[Turn]) -> None:
    """The segment is the last turn's prompt + output; every turn's prompt + output is a prefix of
    it; mask, logprobs and versions are set exactly on each turn's sampled tokens."""
    last = turns[-1]
    assert segment.token_ids == last.prompt_ids + last.output_ids
    mask, logprobs, versions = [0] * len(segment.token_ids), [0.0] * len(segment.token_ids), [-1] * len(segment.token_ids)
    for turn in turns:
        start, end = len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.output_ids)
        assert segment.token_ids[:end] == turn.prompt_ids + turn.output_ids
        mask[start:end], logprobs[start:end], versions[start:end] = [1] * len(turn.output_ids), turn.output_logprobs, turn.output_versions
        assert (turn.turn_index, start, end) in segment.turn_spans
    assert segment.loss_mask == mask and segment.logprobs == logprobs and segment.versions == versions


def assert_prompts_render_the_conversation(tokenizer, turns: list[Turn], **template_kw) -> None:
    """Each turn's prompt ids are its messages rendered by the chat template."""
    for turn in turns:
        rendered = tokenizer.apply_chat_template(turn.messages, add_generation_prompt=True, tokenize=False, **template_kw)
        assert tokenizer.decode(turn.prompt_ids, skip_special_tokens=False) == rendered


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The two models have the same parameters, name by name, bit for bit."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def assert_openai_error(response: httpx.Response) -> dict:
    """The response is an OpenAI-shaped error; returns it."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    return error


def assert_api_error(response: httpx.Response, path: str) -> dict:
    """The error in the shape of the API that was called: Anthropic's under /v1/messages."""
    if not path.startswith("/v1/messages"):
        return assert_openai_error(response)
    body = response.json()
    assert body.get("type") == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], response.text
    return body["error"]


# -- vLLM ------------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def one_vllm_server() -> AsyncIterator[None]:
    """Held while a test module's vLLM server runs: the test workers take turns, since two vLLM
    servers beside the rest of the suite overload 2 cores (a bus acknowledgement then took over
    10 s in a full run). A lock on a file, freed when its holder's process ends."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "flywheel-tests-vllm.lock", "a") as lock:
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
