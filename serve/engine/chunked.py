"""Chunked prefill: how much prompt the engine prefills between two decode steps.

Each round of the engine (one decode step of the running batch) prefills at most `budget`
prompt tokens (`serve.chunked_prefill_size`), so a long prompt cannot stall the running streams
for its whole prefill: it is prefilled in pieces, one per round, each piece attending to the
keys and values of the earlier ones, held in a `PartialPrefill` on the request until its last
piece. Waiting requests are taken in arrival order: those whose (remaining) prompt fits in what
is left of the budget are prefilled together as one `KVBatch.prefill`; the first that does not
fit gets a piece of the rest of the budget (the longest request then waits at the front of the
queue, no later request overtakes it, and at most one request is part-prefilled at a time).

A part-prefilled request stays in the engine's waiting queue, so aborting, retracting or
failing waiting requests covers it too. A weight swap between two of its pieces leaves the
earlier pieces as they were computed, as an in-place swap leaves a running request's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from serve.engine.batch import Prefill, attention_kernels


@dataclass
class PartialPrefill:
    """The first `done` tokens of one sequence, run through the model."""

    cache: DynamicCache = field(default_factory=DynamicCache)
    done: int = 0

    def advance(self, model: torch.nn.Module, sequence: list[int], count: int) -> Prefill | None:
        """Run the next `count` tokens of `sequence`; the finished `Prefill` once it is whole."""
        end = self.done + count
        device = next(model.parameters()).device
        ids = torch.tensor([sequence[self.done:end]], device=device)
        positions = torch.arange(self.done, end, device=device).unsqueeze(0)
        with attention_kernels(device):
            out = model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.done = end
        if end < len(sequence):
            return None
        layers = self.cache.layers
        return Prefill([[layer.keys[0] for layer in layers]], [[layer.values[0] for layer in layers]], out.logits[:, -1])


@dataclass
class Plan:
    """One round's prefill work: `whole` requests prefilled together, and a `piece` of one more."""

    whole: list[Any]
    piece: tuple[Any, int] | None


def plan(waiting: list[Any], room: int, budget: int) -> Plan:
    """What to prefill this round from `waiting` (requests in arrival order, each with `tokens`:
    its sequence, and `partial`: its `PartialPrefill` or None) with `room` free rows and `budget`
    prompt tokens (see the module docstring)."""
    whole: list[Any] = []
    for request in waiting:
        if len(whole) == room or budget <= 0:
            break
        left = len(request.tokens) - (request.partial.done if request.partial else 0)
        if left > budget:
            return Plan(whole, (request, budget))
        if request.partial is not None:  # its last piece: it completes alone
            return Plan(whole, (request, left))
        whole.append(request)
        budget -= left
    return Plan(whole, None)
