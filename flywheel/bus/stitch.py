"""Stitch one conversation's turns into token segments with loss masks, logprobs and versions.

Turns are taken in their conversation's order (flywheel/collect/lineage.py). A turn whose prompt ids
start with everything the current segment holds (the previous prompts and sampled outputs,
exactly) extends that segment: the new prompt tokens (user text, tool output, template glue)
join with mask 0, the sampled tokens with mask 1. Otherwise (a chat template that rewrote
history, or a client that edited it) the turn starts a new segment. No text is ever
re-tokenized. A turn named in `untrained` (one the client did not finish, a turn cut at
max_tokens under `collect.truncated_turns: mask`) is context: its sampled tokens join with mask
0, logprob 0 and version -1, and `masked` counts them by reason. A trajectory's turns then go
without their token lists (`without_tokens`): their tokens are in its segments.
"""

from __future__ import annotations

import msgspec

from flywheel.bus.arrays import Float64s, Int8s, Int32s
from flywheel.bus.records import Segment, Turn

_ZERO_MASK, _SAMPLED_MASK, _ZERO_LOGPROB, _NO_VERSION = Int8s([0]), Int8s([1]), Float64s([0.0]), Int32s([-1])


def _starts_with(ids: Int32s, prefix: Int32s) -> bool:
    return len(ids) >= len(prefix) and ids[: len(prefix)] == prefix


def stitch(turns: list[Turn], first_position: int = 0, untrained: dict[str, str] | None = None,
           masked: dict[str, int] | None = None) -> list[Segment]:
    """Segments for `turns`, which must already be in order; their spans name each turn by its
    position, `first_position` for the first."""
    segments: list[Segment] = []
    for position, turn in enumerate(turns, first_position):
        current = segments[-1] if segments else None
        if current is None or not _starts_with(turn.prompt_ids, current.token_ids):
            current = Segment(token_ids=Int32s(), loss_mask=Int8s(), logprobs=Float64s(), versions=Int32s())
            segments.append(current)
        glue = turn.prompt_ids[len(current.token_ids):]
        current.token_ids.extend(glue)
        current.loss_mask.extend(_ZERO_MASK * len(glue))
        current.logprobs.extend(_ZERO_LOGPROB * len(glue))
        current.versions.extend(_NO_VERSION * len(glue))
        start = len(current.token_ids)
        current.token_ids.extend(turn.output_ids)
        reason = (untrained or {}).get(turn.id)
        if reason is None:
            current.loss_mask.extend(_SAMPLED_MASK * len(turn.output_ids))
            current.logprobs.extend(turn.output_logprobs)
            current.versions.extend(turn.output_versions)
        else:
            current.loss_mask.extend(_ZERO_MASK * len(turn.output_ids))
            current.logprobs.extend(_ZERO_LOGPROB * len(turn.output_ids))
            current.versions.extend(_NO_VERSION * len(turn.output_ids))
            if masked is not None:
                masked[reason] = masked.get(reason, 0) + len(turn.output_ids)
        current.turn_spans.append((position, start, len(current.token_ids)))
    return segments


def without_tokens(turn: Turn) -> Turn:
    """`turn` without its token lists, as a trajectory holds it (its tokens are in the segments)."""
    return msgspec.structs.replace(
        turn, prompt_ids=Int32s(), output_ids=Int32s(), output_logprobs=Float64s(), output_versions=Int32s()
    )
