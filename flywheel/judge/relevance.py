"""Whether a reply answers the request it was given, as the base model sees it.

A reply answers a request when the request makes it likelier: the pointwise mutual information
of reply and request under the teacher's model, untold of any hint,

    Σ_t log p(y_t | context, request, y_<t) − log p(y_t | context, an empty request, y_<t),

is above zero. A reply that would be written as readily to no request at all ("Sure, I'd be
happy to help!", the system message said back, a fact about something else) carries no
information about it and scores at or below zero; an answer, however short or long, scores
above. It is measured with two prefill-only requests to the teacher's server
(`/engine/score`), the request's message emptied in the second, the conversation before it and
the system message kept (so saying back what the system message says is not an answer). No
threshold to tune: zero is where the request stops mattering. (The trainer's adapter guard,
flywheel/train/adapter_guard.py, reads the same information of a version's replies in process,
against another question; the judge has only the teacher's server.)

Practice rewarded by checks (flywheel/formats/wish_checks.py) ranks a reply that does not answer
last, whatever its form: "at most 30 words" is met by a reply that says nothing, and learning
that is learning to stop answering.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from flywheel.bus.instructions import without_request
from flywheel.judge.teacher import Teacher


async def information(teacher: Teacher, messages: list[dict[str, Any]], output_ids: list[int],
                      instructions: Sequence[str] = ()) -> float | None:
    """How much likelier the request makes the reply `output_ids`, in nats (see the module); None
    when the teacher's server could not say."""
    told, untold = await asyncio.gather(teacher.score(messages, output_ids),
                                        teacher.score(without_request(messages, instructions), output_ids))
    if told is None or untold is None:
        return None
    return sum(told["logprobs"]) - sum(untold["logprobs"])
