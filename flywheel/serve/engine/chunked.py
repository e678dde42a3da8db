"""Chunked prefill: how much prompt the engine prefills between two decode steps.

Each round of the engine (one decode step of the running batch) prefills at most `budget`
prompt tokens (`serve.chunked_prefill_size`), so a long prompt cannot stall the running streams
for its whole prefill: it is prefilled in pieces, one per round, each piece attending to the
keys and values of the earlier ones, held in a `PartialPrefill` on the request until its last
piece. Waiting requests are taken in `admission_order`: those whose (remaining) prompt fits in
what is left of the budget are prefilled together as one `KVBatch.prefill`. The first that does
not fit ends the round. Only a prompt longer than the whole budget is split: it gets a piece of
what is left, and goes first from then on (at most one request is part-prefilled at a time; its
last piece joins a round of whole prompts; requests a `retract` pause sent back, mid-generation,
go first too). A prompt that fits in a round of its own waits for the next one instead: a piece
is a forward of its own (on a CPU ~70 ms for a few tokens, most of it fixed cost) and the
prompt's first token would still wait for the next round (docs/experiments/engine-vs-vllm-first-token.md).

The order (`serve.schedule_policy`) is `shortest-first` by default: the request with the least
prompt left to prefill goes first, so a burst's short prompts do not wait behind its long ones
(every request's wait is the prefill of those before it: this order makes the waits shortest
in sum, and most of them short). A request passed over by later ones in `OVERTAKEN_LIMIT`
rounds goes first among the rest, in arrival order, so a long prompt waits a bounded number of
rounds however many short ones keep coming. `fcfs`: arrival order, no one overtakes.

A part-prefilled request stays in the engine's waiting queue, so aborting, retracting or
failing waiting requests covers it too. A weight swap between two of its pieces leaves the
earlier pieces as they were computed, as an in-place swap leaves a running request's cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from flywheel.models.lora_batch import Rows, applied
from flywheel.serve.engine.kv_cache import Prefill, attention_kernels


@dataclass
class PartialPrefill:
    """The first `done` tokens of one sequence, run through the model."""

    cache: DynamicCache = field(default_factory=DynamicCache)
    done: int = 0

    def advance(self, model: torch.nn.Module, sequence: list[int], count: int, lora: Rows | None = None) -> Prefill | None:
        """Run the next `count` tokens of `sequence` (with the adapter of `lora`'s one row, if
        any); the finished `Prefill` once it is whole."""
        end = self.done + count
        device = next(model.parameters()).device
        ids = torch.tensor([sequence[self.done:end]], device=device)
        positions = torch.arange(self.done, end, device=device).unsqueeze(0)
        with attention_kernels(device), applied(lora):
            out = model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.done = end
        if end < len(sequence):
            return None
        layers = self.cache.layers
        return Prefill([[layer.keys[0] for layer in layers]], [[layer.values[0] for layer in layers]], out.logits[:, -1])


OVERTAKEN_LIMIT = 8
"""Rounds in which later requests may be admitted before a waiting one; then it goes first."""

SchedulePolicy = Literal["shortest-first", "fcfs"]


@dataclass
class Plan:
    """One round's prefill work: `whole` requests prefilled together, and a `piece` of one more."""

    whole: list[Any]
    piece: tuple[Any, int] | None

    @property
    def admitted(self) -> list[Any]:
        return self.whole + ([self.piece[0]] if self.piece else [])


def _left(request: Any) -> int:
    return len(request.tokens) - (request.partial.done if request.partial else 0)


def admission_order(waiting: Sequence[Any], policy: SchedulePolicy) -> list[Any]:
    """`waiting` (in arrival order) in the order a round considers them. For `shortest-first`:
    the part-prefilled request and those sent back mid-generation (a `retract` pause: they have
    output) first, then those overtaken `OVERTAKEN_LIMIT` times, both in arrival order, then the
    rest by the prompt they have left (ties in arrival order). For `fcfs`, arrival order (the
    part-prefilled request is then always the first)."""
    if policy == "fcfs":
        return list(waiting)

    def key(request: Any) -> tuple[bool, bool, int]:
        started = request.partial is not None or bool(request.output_ids)
        starved = request.overtaken >= OVERTAKEN_LIMIT
        return not started, not starved, 0 if started or starved else _left(request)

    return sorted(waiting, key=key)  # stable: equal keys keep their arrival order


def plan(waiting: Sequence[Any], room: int, budget: int, policy: SchedulePolicy,
         may_enter: Callable[[Any], bool] = lambda request: True) -> Plan:
    """What to prefill this round from `waiting` (requests in arrival order, each with `tokens`:
    its sequence, `partial`: its `PartialPrefill` or None, and `overtaken`: a count of rounds)
    with `room` free rows and `budget` prompt tokens (see the module docstring); a request that
    would be admitted is passed over when `may_enter(request)` says it may not enter yet (called
    once it fits, as its last check: a request's adapter slot). Each request left waiting that a
    later one was admitted before counts the round in its `overtaken`."""
    whole: list[Any] = []
    work = Plan(whole, None)
    full = budget
    for request in admission_order(waiting, policy):
        if room == 0 or budget <= 0:
            break
        left = _left(request)
        split = left > budget and (request.partial is not None or left > full)  # a prompt longer than a round: in pieces
        if left > budget and not split:  # it fits in a round of its own: not split, it waits for the next
            break
        if not may_enter(request):
            continue
        if split:
            work.piece = (request, budget)
            break
        if request.partial is not None:  # its last piece: it joins this round
            work.piece = (request, left)
        else:
            whole.append(request)
        budget -= left
        room -= 1
    admitted = {id(r) for r in work.admitted}
    later = False
    for request in reversed(waiting):  # newest first: has one that arrived after it been admitted?
        if id(request) in admitted:
            later = True
        elif later:
            request.overtaken += 1
    return work
