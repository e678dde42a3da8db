"""Constrained decoding: SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag` sampling
parameters, compiled with llguidance (the CPU grammar engine SGLang offers as
`--grammar-backend llguidance`), read the way that backend reads them:

    json_schema      a JSON Schema (as a string)
    regex            a regular expression the whole output matches
    ebnf             a Lark grammar (llguidance's dialect, which can embed JSON schemas with
                     `%json {...}`) or a GBNF grammar
    structural_tag   `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free
                     text, and after a trigger, `begin`, JSON matching `schema`, `end`

Before each token of a constrained request, the tokens the grammar does not allow are masked
out of the logits (so the recorded behaviour logprob is that of the masked distribution, which
is what the token was drawn from); once the grammar is complete, only the end-of-sequence token
is allowed, so a constrained answer ends the way any answer does. The tokenizer's llguidance
view is built on the first constrained request.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from bus.lru import LRU

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
COMPILED_GRAMMARS = 256
"""How many compiled constraints an engine keeps (least recently used forgotten first)."""


class GrammarError(ValueError):
    """A constraint that cannot be compiled (SGLang rejects the request)."""


class Grammars:
    def __init__(self, tokenizer: Any, n_vocab: int, eos_ids: set[int]):
        self.hf_tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None
        self._compiled: LRU[tuple[str, str], str] = LRU(COMPILED_GRAMMARS)
        """Recently compiled constraints (the protocol layer checks a request's before the engine
        takes it; repeated schemas are the common case)."""

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self.hf_tokenizer, self.n_vocab, eos_token=self.eos_ids or None)
        return self._tokenizer

    @staticmethod
    def constraint(params: Any) -> tuple[str, str] | None:
        """(key, value) of the one constraint in `params`, None without one."""
        given = [(key, getattr(params, key)) for key in GRAMMAR_KEYS if getattr(params, key) is not None]
        if len(given) > 1:
            raise GrammarError(f"give at most one of {', '.join(GRAMMAR_KEYS)} (got {', '.join(k for k, _ in given)})")
        return given[0] if given else None

    def serialized(self, key: str, value: str) -> str:
        """llguidance's grammar for one constraint; GrammarError naming the key if invalid."""
        grammar = self._compiled.get((key, value))
        if grammar is None:
            grammar = self._compile(key, value)
            self._compiled[(key, value)] = grammar
        return grammar

    def _compile(self, key: str, value: str) -> str:
        from llguidance import LLMatcher, StructTag, grammar_from

        try:
            if key == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(value)
            elif key == "regex":
                grammar = grammar_from("regex", value)
            elif key == "ebnf":
                grammar = grammar_from("ebnf", value)
            else:
                tag = json.loads(value)
                grammar = StructTag.to_grammar([
                    StructTag(begin=s["begin"], grammar=s["schema"], end=s["end"], trigger=tag["triggers"][0])
                    for s in tag["structures"]
                ])
        except Exception as exc:
            raise GrammarError(f"{key} is not a valid constraint: {exc}") from None
        valid, error = _validate(grammar, self.tokenizer)
        if not valid:
            raise GrammarError(f"{key} is not a valid constraint: {error}")
        return grammar

    def matcher(self, params: Any) -> Any:
        """A fresh matcher for the request's constraint (None without one)."""
        from llguidance import LLMatcher

        constraint = self.constraint(params)
        if constraint is None:
            return None
        return LLMatcher(self.tokenizer, self.serialized(*constraint))


def _validate(grammar: str, tokenizer: Any) -> tuple[bool, str]:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return not is_error, "; ".join(messages)


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
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[1]
    bitmask = allocate_token_bitmask(len(rows), vocab)
    for k, i in enumerate(rows):
        fill_next_token_bitmask(matchers[i], bitmask, k)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


_BITS = torch.arange(32, dtype=torch.int32)
