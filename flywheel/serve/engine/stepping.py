"""From one forward pass's next-token logits to the tokens its rows record: each row's bans and
grammar applied, one batched draw (`sampling.sample`), each request's token, behaviour logprob
and weight version (the engine's, or its adapter's) appended, and the step's deltas for the streams that wait for them.

What goes wrong for one row (its bans, a distribution that is not finite, its finish checks)
marks that request failed; the other rows go on.
"""

from __future__ import annotations

import asyncio
import time

import torch

from flywheel.serve.engine.grammar import apply_grammars
from flywheel.serve.engine.request import Request, TokenDelta, post_deltas
from flywheel.serve.engine.sampling import sample

Deltas = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]]


def sample_rows(rows: list[Request], logits: torch.Tensor, versions: list[str]) -> tuple[int, Deltas]:
    """Sample each row's next token from `logits` [rows, vocab], row i's under the weights
    labelled `versions[i]`; returns how many tokens were recorded and the deltas to post (`post`)."""
    for i, request in enumerate(rows):
        try:
            banned = request.banned_now()
            if banned:
                logits[i, banned] = float("-inf")
        except Exception as exc:
            request.mark_failed(f"could not ban its stop tokens: {exc}")
    apply_grammars(rows, logits)
    top_n = max(r.params.top_logprobs_num for r in rows)
    tokens, logprobs, top, failed = sample(logits, [r.params for r in rows], [r.generator for r in rows], top_n)
    for i in failed:
        rows[i].mark_failed("its next-token probabilities are not finite (a temperature too small for "
                            "logits / temperature, or the model produced NaN or inf)")
    tokens, logprobs = tokens.tolist(), logprobs.tolist()  # one copy (one sync on a GPU), not one per row
    now = time.monotonic()
    recorded = 0
    deltas: Deltas = {}
    for i, request in enumerate(rows):
        if request.error is not None:
            continue
        tops = top[i][: request.params.top_logprobs_num] if top is not None else None
        try:
            delta = request.append(tokens[i], logprobs[i], versions[i], tops, now)
        except Exception as exc:
            request.mark_failed(f"its finish checks raised: {exc}")
            continue
        recorded += 1
        if request.queue is not None:
            deltas.setdefault(request.loop, []).append((request.queue, delta))
    return recorded, deltas


def post(deltas: Deltas) -> None:
    """Put the deltas on their streams' queues, on each stream's event loop."""
    for loop, items in deltas.items():
        post_deltas(loop, items)
