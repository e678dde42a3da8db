"""Constrained decoding: SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag` sampling
parameters, compiled with llguidance (`flywheel/formats/grammar.py`, shared with the trainer, which
replays the same grammars to recompute the tokens sampled under them).

Before each token of a constrained request, the tokens the grammar does not allow are masked
out of the logits (so the recorded behaviour logprob is that of the masked distribution, which
is what the token was drawn from); once the grammar is complete, only the end-of-sequence token
is allowed, so a constrained answer ends the way any answer does. The tokenizer's llguidance
view is built on the first constrained request.
"""

from __future__ import annotations

from typing import Any

import torch

from flywheel.formats.grammar import (
    GRAMMAR_KEYS,
    TokenGrammar,
    allowed_tokens,
    constraint,
    fill_bitmask,
    new_bitmask,
)


class Grammars(TokenGrammar):
    """One engine's grammars, with its own cache of compiled constraints."""

    @staticmethod
    def constraint(params: Any) -> tuple[str, str] | None:
        """(key, value) of the one constraint in `params` (`SamplingParams`), None without one."""
        return constraint({key: getattr(params, key) for key in GRAMMAR_KEYS})

    def matcher(self, params: Any) -> Any:
        """A fresh matcher for the request's constraint (None without one)."""
        given = self.constraint(params)
        return None if given is None else self.new_matcher(*given)


def apply_grammars(rows: list[Any], logits: torch.Tensor) -> None:
    """Mask each constrained request's row of `logits` (rows in the order of `rows`); if the
    masks cannot be computed, the constrained requests fail and the others go on."""
    matchers = [request.matcher for request in rows]
    if all(m is None for m in matchers):
        return
    try:
        mask_logits(logits, matchers)
    except Exception as exc:
        for request in rows:
            if request.matcher is not None:
                request.mark_failed(f"could not apply its grammar: {exc}")


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> None:
    """Mask, in place, the tokens each row's matcher does not allow next (rows without one are
    left alone). The bitmask is unpacked with plain tensor ops (llguidance's own kernel is a
    `torch.compile` one, which on CPU would compile C++ on the first call)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[1]
    bitmask = new_bitmask(len(rows), vocab)
    for k, i in enumerate(rows):
        fill_bitmask(matchers[i], bitmask, k)
    allowed = allowed_tokens(bitmask, vocab).to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
