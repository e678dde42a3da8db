"""One episode through the endpoint: the loop between the model and an environment.

Every reply is a chat turn through the OpenAI endpoint (the official `openai` client) in one
session (`X-Session-Id`, one per episode) of one task group (`X-Task-Id`, `X-Group-Size`): the
gateway records each turn's exact tokens and the collector stitches them into one multi-turn
trajectory, where the environment's observations are prompt tokens (outside the loss). The reply
goes to `Episode.step`; its observation is appended after the reply, as a chat client would.

The episode ends when the environment says so, at `rollout.episode.max_turns` replies, when its
token budget (`max_tokens`) is spent, when the model's context is full (the endpoint answers
400) or at `timeout_s`; it is then graded and the grade is sent as session feedback (source
`env`, details included), which closes the session. An episode that fails for any other reason
(its environment crashed, the endpoint is gone) is reported as feedback without a reward, with
the reason: the judge publishes it as unscored and nothing is trained on it.

Environment calls may block (sandboxed commands, test suites), so they run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from flywheel.config import FlywheelConfig
from flywheel.envs import Env, Episode, Grade, Task

log = logging.getLogger(__name__)


@dataclass
class EpisodeResult:
    session_id: str
    reward: float | None
    """None: the episode failed and was reported unscored (`end` says why)."""
    turns: int = 0
    sampled_tokens: int = 0
    end: str = ""
    """Why acting stopped: `done`, `max_turns`, `max_tokens`, `context`, `timeout`, or the failure."""
    details: dict[str, Any] = field(default_factory=dict)


class Endpoint:
    """The clients an episode talks through: chat turns and session feedback, authenticated with
    the key in `FLYWHEEL_API_KEY` when the gateway asks for one (`serve.api_keys`)."""

    def __init__(self, base_url: str, model: str):
        self.model = model
        key = os.environ.get("FLYWHEEL_API_KEY", "flywheel")
        self.openai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=3, timeout=600)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})

    async def feedback(self, session_id: str, body: dict[str, Any]) -> None:
        response = await self.http.post(f"/v1/sessions/{session_id}/feedback", json={"source": "env", **body})
        response.raise_for_status()

    async def close(self) -> None:
        await self.openai.close()
        await self.http.aclose()


async def run_episode(
    endpoint: Endpoint,
    env: Env,
    task: Task,
    session_id: str,
    config: FlywheelConfig,
    slot: int = 0,
    turn_length: int | None = None,
    extra_body: dict[str, Any] | None = None,
) -> EpisodeResult:
    """Run one attempt at `task` and report its grade (or its failure) as the session's feedback."""
    result = EpisodeResult(session_id, None)
    try:
        episode = await asyncio.to_thread(env.open, task, slot)
    except Exception as exc:  # the environment could not start this task: this episode fails alone
        return await report_failure(endpoint, result, f"environment failed to open the task: {exc!r}")
    try:
        try:
            async with asyncio.timeout(config.rollout.episode.timeout_s):
                await _act(endpoint, episode, task, session_id, config, result, turn_length, extra_body)
        except TimeoutError:
            result.end = "timeout"
        grade: Grade = await asyncio.to_thread(episode.finish)
    except Exception as exc:
        return await report_failure(endpoint, result, f"{result.end or 'acting'}: {exc!r}")
    finally:
        await asyncio.to_thread(episode.close)
    result.reward, result.details = grade.reward, grade.details
    details = {**grade.details, "turns": result.turns, "end": result.end}
    await endpoint.feedback(session_id, {"reward": grade.reward, "details": details})
    return result


async def _act(endpoint: Endpoint, episode: Episode, task: Task, session_id: str, config: FlywheelConfig,
               result: EpisodeResult, turn_length: int | None, extra_body: dict[str, Any] | None) -> None:
    limits, sampling = config.rollout.episode, config.rollout.sampling
    messages = list(task.messages)
    headers = {"X-Session-Id": session_id, "X-Task-Id": task.id, "X-Group-Size": str(sampling.n_samples)}
    while True:
        if result.turns >= limits.max_turns:
            result.end = "max_turns"
            return
        length = turn_length or sampling.max_new_tokens
        if limits.max_tokens is not None:
            length = min(length, limits.max_tokens - result.sampled_tokens)
            if length <= 0:
                result.end = "max_tokens"
                return
        try:
            completion = await endpoint.openai.chat.completions.create(
                model=endpoint.model, messages=messages, max_tokens=length, temperature=sampling.temperature,
                top_p=sampling.top_p, extra_headers=headers, extra_body=extra_body or {},
            )
        except openai.BadRequestError as exc:
            if result.turns and exc.code == "context_length_exceeded":  # the conversation outgrew the model
                result.end = "context"
                return
            raise
        result.turns += 1
        result.sampled_tokens += completion.usage.completion_tokens if completion.usage else 0
        reply = completion.choices[0].message.content or ""
        step = await asyncio.to_thread(episode.step, reply)
        if step.done:
            result.end = "done"
            return
        messages += [{"role": "assistant", "content": reply}, *step.messages]


async def report_failure(endpoint: Endpoint, result: EpisodeResult, reason: str) -> EpisodeResult:
    """Log the failure and tell the session, when it has one: an episode that failed before its
    first request never opened a session (the gateway answers 404), and has nothing to train."""
    log.warning("episode %s failed: %s", result.session_id, reason)
    result.end = reason
    try:
        await endpoint.feedback(result.session_id, {"text": f"episode failed: {reason}", "details": {"failed": reason}})
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 404:
            raise
    return result
