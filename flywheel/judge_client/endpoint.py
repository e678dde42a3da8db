"""A judge's connection to an OpenAI-compatible endpoint: bounded concurrency, retries with
backoff, and every request marked as a side turn. Shared by the `llm` judge (`flywheel/judge/llm.py`) and
the promotion gate's pairwise judge (`flywheel/promote/traffic_suite.py`).

One `AsyncOpenAI` client (its own retries off: the retry policy is here, so it is the same
for every endpoint and visible in the stats). At most `max_concurrency` requests are in flight.
A connection error, a timeout, a 408, a 429 or a 5xx is retried up to `max_retries` times
after `retry_backoff_s`, doubled each time (the second half of each pause random), capped at `retry_backoff_max_s`;
a `Retry-After` header is honoured (up to the same cap). Other errors (400, 401, 404, ...) are
not retried. Every request carries `X-Turn-Type: side`, so when the endpoint is Flywheel's own
serve loop the judge's requests are served and recorded but never trained on.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai

from flywheel.config.judge import LLMJudgeConfig

RETRYABLE_STATUS = frozenset({408, 429})


class EndpointError(Exception):
    """The endpoint did not answer usably (after the retries, where the error was retryable)."""


def _retryable(error: openai.OpenAIError) -> bool:
    if isinstance(error, openai.APIConnectionError):  # includes APITimeoutError
        return True
    return isinstance(error, openai.APIStatusError) and (error.status_code in RETRYABLE_STATUS or error.status_code >= 500)


def _retry_after_s(error: openai.OpenAIError) -> float | None:
    response = getattr(error, "response", None)
    try:
        return float(response.headers["retry-after"]) if response is not None else None
    except (KeyError, ValueError):
        return None


class JudgeEndpoint:
    def __init__(self, config: LLMJudgeConfig, base_url: str, api_key: str, model: str):
        self.config = config
        self.base_url = base_url
        self.model = model
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=config.request_timeout_s
        )
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self.requests = 0
        self.retries = 0
        self.failures = 0

    async def complete(self, messages: list[dict[str, str]], session_id: str) -> str:
        """The judge model's reply to `messages`, retrying what is worth retrying."""
        cfg = self.config
        attempt = 0
        while True:
            try:
                async with self._slots:
                    self.requests += 1
                    reply = await self.client.chat.completions.create(
                        model=self.model, messages=messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                        extra_headers={"X-Turn-Type": "side", "X-Session-Id": session_id},
                    )
                return _reply_text(reply)
            except openai.OpenAIError as error:
                if not _retryable(error) or attempt >= cfg.max_retries:
                    self.failures += 1
                    raise EndpointError(_describe(error, attempt)) from error
                self.retries += 1
                await asyncio.sleep(self._backoff_s(attempt, _retry_after_s(error)))
                attempt += 1

    def _backoff_s(self, attempt: int, retry_after_s: float | None) -> float:
        cap = self.config.retry_backoff_max_s
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), cap)
        pause = min(cap, self.config.retry_backoff_s * 2**attempt)
        return pause / 2 + random.uniform(0, pause / 2)

    async def close(self) -> None:
        await self.client.close()

    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "retries": self.retries, "failures": self.failures}


def _reply_text(reply: Any) -> str:
    if not reply.choices:
        raise EndpointError("the endpoint returned no choices")
    return reply.choices[0].message.content or ""


def _describe(error: openai.OpenAIError, attempt: int) -> str:
    status = getattr(error, "status_code", None)
    what = f"HTTP {status}" if status else type(error).__name__
    tries = f" after {attempt + 1} attempts" if attempt else ""
    return f"{what}{tries}: {str(error)[:200]}"
