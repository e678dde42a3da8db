"""Serving the best of k sampled replies, ranked by the checks of what the person asked
(`memory.best_of`, flywheel/config/memory.py).

Where the served memory put a person's instructions in a request (flywheel/serve/served_memory.py)
and a rule checks every aspect they ask for (flywheel/formats/wish_checks.py: a reply's length,
lists or prose, register, being named), the gateway samples k replies at once on the request's
engine, reads whether each answers the question as the judge reads it (flywheel/judge/relevance.py:
the request makes the reply likelier under the engine's base, two prefill-only requests with no
adapter), and serves the one the checks rank first, a reply that does not answer ranked below
every one that does. Where they cannot rank them (no reply answers, none differs in what is
checked, the engine could not score one) the first is served, as it would have been alone.

Only the served reply is recorded (`Turn.best_of` says how many it was chosen from): the person's
next message follows it, and the collector stitches that message to the reply they saw; the others
were never shown and are dropped. Each recorded token's behaviour log-prob is its own under the
policy, right for the tokens; the choice among the replies is not a sample of the policy (the
decoupled objective's weights do not correct for it), so what the person's adapter learns from
leans toward their wish by more than its own samples do. Streams (a reply could not start before
every one is read), several choices, tools and response formats are served one reply, as sampled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from flywheel.bus.instructions import without_request
from flywheel.formats.wish_checks import checkable, rewards
from flywheel.serve.api.chat import ChatCompletionRequest, Message
from flywheel.serve.api.sessions import SessionInfo
from flywheel.serve.backends.base import EngineClient, EngineError
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.scoring_server import input_logprobs, rendered


@dataclass
class BestOf:
    """How to choose among a request's k replies."""

    k: int
    aspects: list[str]
    """What the person's served instructions are for (`SessionInfo.aspects`)."""
    messages: list[dict[str, Any]]
    """The request's messages as the model saw them (the checks read the person's names there)."""
    untold_ids: list[int]
    """The prompt without the person's words in its last user message (what the served memory put
    before them kept): a reply the request does not make likelier does not answer it."""

    async def pick(self, engine: EngineClient, prompt_ids: list[int], replies: list[tuple[str, list[int]]]) -> int:
        """The index of the reply (its text, its output ids) to serve."""
        answered = await asyncio.gather(*(self._answers(engine, prompt_ids, ids) for _, ids in replies))
        if any(a is None for a in answered):
            return 0
        scores = rewards(self.aspects, [text for text, _ in replies], self.messages, answered)
        return 0 if scores is None else max(range(len(replies)), key=scores.__getitem__)

    async def _answers(self, engine: EngineClient, prompt_ids: list[int], output_ids: list[int]) -> bool | None:
        """Whether the request makes the reply likelier (None: the engine could not say)."""
        if not output_ids:
            return False
        try:
            told, untold = await asyncio.gather(input_logprobs(engine, prompt_ids, output_ids),
                                                input_logprobs(engine, self.untold_ids, output_ids))
        except EngineError:
            return None
        return sum(e[0] for e in told["input_token_logprobs"][1:]) > sum(e[0] for e in untold["input_token_logprobs"][1:])


async def best_of(k: int, body: Any, session: SessionInfo, prompts: PromptBuilder, model_name: str,
                  forced: str = "", tools_active: bool = False) -> BestOf | None:
    """The choice among `k` replies for a request, where it is made (see the module); else None."""
    if (k < 2 or not isinstance(body, ChatCompletionRequest) or body.stream or body.n != 1 or forced or tools_active
            or body.response_format is not None and body.response_format.constraint() is not None
            or not checkable(list(session.aspects))):
        return None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    untold = [Message.model_validate(m) for m in without_request(messages, session.instructions)]
    return BestOf(k, list(session.aspects), messages, await rendered(prompts, model_name, untold))
