"""Serving the best of k sampled replies to a request the served memory put a person's instructions
in (`memory.best_of`, flywheel/config/memory.py).

Told how to write, SmolLM2-135M answers the question less often (held out, 0.93 of replies
before against 0.75 with the instructions before the question): it writes about the instruction,
or around the topic. So where the served memory (flywheel/serve/served_memory.py) put a person's
instructions in a request, the gateway samples k replies at once on the request's engine, reads
how much each says about the question as the judge reads it (flywheel/judge/relevance.py: how
much likelier the request makes the reply, two prefill-only requests with no adapter: with
adapters the frozen base the judge's teacher reads with, else the served weights), and serves,
among those that answer, the one the checks of what the person asked rank first where a rule
checks every aspect (flywheel/formats/wish_checks.py: a reply's length, lists or prose, register,
being named), else the first (`wish_checks.best`: for `shorter` the most said per character, ties
to the one that says the most; a reply the request does not make likelier, or that says under half
what the one that says the most says, or that the engine cut off, never). Where none answers,
or the engine could not score one, the first that came back is served, as it would have been
alone, and recorded as a plain sample. Both prompts are rendered from the messages as the judge
renders them (the told one, in a conversation, may differ from the ids the session continued).
The engine client must score (the embedded engine, SGLang; not vLLM's: a configuration error).

Only the served reply is recorded (`Turn.best_of` says how many it was chosen from): the person's
next message follows it, and the collector stitches that message to the reply they saw; the others
were never shown and are dropped. The concurrency limit and the metrics count the request once. Each
recorded token's behaviour log-prob is its own under the policy, right for the tokens; the choice
among the replies is not a sample of the policy (the decoupled objective's weights do not correct
for it), so what the person's adapter learns from leans toward their wish by more than its own
samples do. Streams (a reply could not start before every one is read), several choices, greedy
sampling, tools and response formats are served one reply, as sampled. Where the served memory
writes the reply's opening (`memory.opening`), the k replies go on from it, and it is read with each.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from flywheel.bus.instructions import without_request
from flywheel.formats.wish_checks import best
from flywheel.serve.api.chat import GREEDY_BELOW, ChatCompletionRequest, Message
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.formatting import output_text
from flywheel.serve.api.sessions import SessionInfo
from flywheel.serve.backends.base import EngineClient, EngineError
from flywheel.serve.engine_choice import Choice
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.scoring_server import input_logprobs, output_logprobs, rendered


@dataclass
class Reply:
    """One of the k, as the person would be served it."""

    text: str
    output_ids: list[int]
    whole: bool
    """Not cut off by the engine (an abort)."""


@dataclass
class BestOf:
    """How to choose among a request's k replies."""

    k: int
    aspects: list[str]
    """What the person's served instructions are for (`SessionInfo.aspects`)."""
    messages: list[dict[str, Any]]
    """The request's messages as the model saw them (the checks read the person's names there)."""
    told_ids: list[int]
    """The prompt of those messages, rendered afresh."""
    untold_ids: list[int]
    """The prompt without the person's words in its last user message (what the served memory put
    before them kept): a reply the request does not make likelier does not answer it."""
    opening: str = ""
    """What the served memory opens each reply with (`memory.opening`): both prompts end with it,
    and the checks read it at the start of each reply."""

    async def served(self, engine: EngineClient, bodies: list[dict[str, Any]]) -> tuple[int, dict[str, Any], bool]:
        """Of the engine's responses to the k `bodies` (one request's draws), the one to serve:
        (its index, it, whether it was chosen); the first that came back where none could be. A
        draw failing fails the request only if every one does."""
        drawn = await asyncio.gather(*(engine.generate(body) for body in bodies), return_exceptions=True)
        back = [(j, response) for j, response in enumerate(drawn) if not isinstance(response, BaseException)]
        if not back:
            raise drawn[0]
        choices = [Choice.from_response(0, "", response) for _, response in back]
        picked = await self.pick(engine, [Reply(self.opening + output_text(c), c.output_ids, c.finish_reason != "abort")
                                          for c in choices])
        return (*back[picked or 0], picked is not None)

    async def pick(self, engine: EngineClient, replies: list[Reply]) -> int | None:
        """The index of the reply to serve; None where none answers or the engine could not read one
        (serve the first)."""
        gains = await asyncio.gather(*(self._gain(engine, reply) for reply in replies))
        if any(gain is None for gain in gains):
            return None
        return best(self.aspects, [reply.text for reply in replies], self.messages, gains)

    async def _gain(self, engine: EngineClient, reply: Reply) -> float | None:
        """How much likelier the request makes the whole reply, in nats: at or below zero it does not
        answer (0 for one the engine cut off: never served for its form; None: the engine could not
        say)."""
        if not reply.output_ids or not reply.whole:
            return 0.0
        try:
            told, untold = await asyncio.gather(input_logprobs(engine, self.told_ids, reply.output_ids),
                                                input_logprobs(engine, self.untold_ids, reply.output_ids))
            return _total(told) - _total(untold)
        except (EngineError, KeyError, TypeError, IndexError):
            return None


def _total(meta: dict[str, Any]) -> float:
    return sum(output_logprobs(meta))


async def best_of(k: int, body: Any, session: SessionInfo, prompts: PromptBuilder, model_name: str,
                  forced: str = "", tools_active: bool = False) -> BestOf | None:
    """The choice among `k` replies for a request, where it is made (see the module); else None."""
    if (k < 2 or not isinstance(body, ChatCompletionRequest) or body.stream or body.n != 1 or tools_active
            or body.temperature < GREEDY_BELOW
            or body.response_format is not None and body.response_format.constraint() is not None
            or not (session.instructions or session.opening)):
        return None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    untold = [Message.model_validate(m) for m in without_request(messages, session.instructions)]
    try:
        told_ids = await rendered(prompts, model_name, body.messages, forced)
        untold_ids = await rendered(prompts, model_name, untold, forced)
    except APIError:  # the template refuses the emptied request: no reading of answers, one reply
        return None
    return BestOf(k, list(session.aspects), messages, told_ids, untold_ids, forced)
