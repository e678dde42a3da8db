"""Admission: what a round of the embedded engine (`core.Engine`) takes into its running batch,
and whether the round ends with a decode step.

A round plans its prefill with `chunked.plan` (the budget, the order, pieces of a long prompt;
a request that names a LoRA adapter is admitted only once it holds its adapter's slot, else it
stays waiting and later ones may go before it), scores a newcomer's input if asked, prefills the
whole prompts together (one by one if that fails, to find the request to blame) or the next
piece of a long one, each row with its adapter, and puts the prefilled rows into the batch with
their first tokens sampled. While prompts wait and a row is free, the next round prefills more
instead of decoding, until the running streams' last tokens are `max_stall_s` old (SGLang runs a
prefill batch whenever it can form one, with no such bound), unless no waiting request could be
admitted (each waits for an adapter slot that running requests hold).

`Admission` is a part of `Engine`, kept in its own file: it uses the engine's queue, batch,
model and its helpers for failing, completing and sampling requests, on the engine's thread.
"""

from __future__ import annotations

import logging
import time

from flywheel.serve.engine.chunked import PartialPrefill, plan
from flywheel.serve.engine.input_logprobs import score_input
from flywheel.serve.engine.kv_cache import Prefill
from flywheel.serve.engine.request import Request, RequestFailed

log = logging.getLogger(__name__)


class Admission:
    """The engine's admission of waiting requests (see the module docstring)."""

    def _admit(self) -> None:
        with self._wake:
            waiting = list(self._waiting)  # planned outside the lock: holding an adapter may read it from disk
        work = plan(waiting, self.max_batch_size - len(self._rows), self.chunked_prefill_size, self.schedule_policy,
                    self._hold_adapter)
        self._admission_blocked = bool(waiting) and not work.admitted
        with self._wake:
            for request in work.whole:  # a part-prefilled request stays waiting until its last piece
                self._waiting.remove(request)
        new = [r for r in work.whole if self._arrive(r)]
        if work.piece is not None:
            self._advance(*work.piece)
        for rows, prefill in self._prefill(new) if new else []:
            self._enter(rows, prefill)
        self._drop_finished()

    def _decode_due(self) -> bool:
        """Whether this round ends with a decode step: not while prompts wait, a row is free for them
        and the running streams' last tokens are younger than `max_stall_s` (the next round prefills),
        unless this round could admit none of them (they wait for adapter slots rows hold)."""
        prefill_waits = bool(self._waiting) and len(self._rows) < self.max_batch_size and not self._admission_blocked
        return not prefill_waits or time.monotonic() - self._tokens_at >= self.max_stall_s

    def _arrive(self, request: Request) -> bool:
        """A request's first admission: score its input if asked; whether it goes on to be prefilled
        (not when that failed, nor when it generates nothing)."""
        request.started = request.started or time.monotonic()
        if request.error is None:
            score_input(self.model, request, self._lora([request]))
        if request.error is not None:
            self._fail(request, request.error)
        elif request.finish is not None:  # max_new_tokens=0 (scoring only): nothing to generate
            self._complete(request)
        else:
            return True
        return False

    def _advance(self, request: Request, count: int) -> None:
        """Prefill the next `count` tokens of the waiting `request`; it joins the batch after its
        last piece. A piece that raises fails the request alone."""
        try:
            if request.partial is None and not self._arrive(request):
                prefill = None
            else:
                request.partial = request.partial or PartialPrefill()
                if (prefill := request.partial.advance(self.model, request.tokens, count, self._lora([request]))) is None:
                    return
        except Exception as exc:
            prefill = self._prefill_failed(request, exc)
        with self._wake:
            self._waiting.remove(request)
        request.partial = None
        if prefill is not None:
            self.stats["prefills"] += 1
            self._enter([request], prefill)

    def _enter(self, rows: list[Request], prefill: Prefill) -> None:
        # Rows join the running batch before they are sampled: whatever happens next, the
        # engine knows them (a failure fails them, never leaves them waiting forever).
        self._batch.add(prefill)
        if not self._rows:  # the first rows: their first tokens are the oldest
            self._tokens_at = time.monotonic()
        self._rows.extend(rows)
        self._sample(rows, prefill.logits)

    def _prefill(self, new: list[Request]) -> list[tuple[list[Request], Prefill]]:
        """Prefill `new` together; if that fails, each alone, so that only a request whose own prefill
        fails (a token id the model has no embedding for, say) fails. The running batch is untouched."""
        try:
            prefill = self._batch.prefill(self.model, [r.tokens for r in new], self.pad_id, self._lora(new))
        except Exception as exc:
            if len(new) > 1:
                return [part for request in new for part in self._prefill([request])]
            return self._prefill_failed(new[0], exc) or []
        self.stats["prefills"] += 1
        return [(new, prefill)]

    def _prefill_failed(self, request: Request, exc: Exception) -> None:
        log.exception("prefill of request %s failed", request.rid)
        self._fail(request, RequestFailed(f"request {request.rid} failed: its prefill raised: {exc}"))
