"""Grammars over a model's tokens, shared by the engine that samples under them and the trainer
that recomputes what it sampled.

A constraint is one of SGLang's sampling parameters `json_schema`, `regex`, `ebnf` or
`structural_tag`, compiled with llguidance (the CPU grammar engine SGLang offers as
`--grammar-backend llguidance`), read the way that backend reads them:

    json_schema      a JSON Schema (as a string)
    regex            a regular expression the whole output matches
    ebnf             a Lark grammar (llguidance's dialect, which can embed JSON schemas with
                     `%json {...}`) or a GBNF grammar
    structural_tag   `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free
                     text, and after a trigger, `begin`, JSON matching `schema`, `end`

The tokens a grammar allows next are llguidance's bitmask: int32 words, bit j of word w standing
for token 32·w + j, one row per position ([n, ceil(vocab / 32)]: vocab / 8 bytes a position).
`TokenGrammar` holds the llguidance view of one tokenizer, sized to the model's logits (which may
be wider than the tokenizer: tokens past its end are never allowed), with its end tokens (a
complete grammar allows only them). The engine masks each constrained request's logits with a
matcher it advances token by token; `TokenGrammar.replay` runs the same matcher over tokens
already sampled and returns the masks they were drawn under.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flywheel.lru import LRU

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
COMPILED_GRAMMARS = 256
"""How many compiled constraints a `TokenGrammar` keeps (least recently used forgotten first)."""
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (SGLang rejects the request), or tokens it rejects."""


def constraint(params: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, value) of the one constraint among sampling parameters, None without one."""
    given = [(key, params[key]) for key in GRAMMAR_KEYS if params.get(key) is not None]
    if len(given) > 1:
        raise GrammarError(f"give at most one of {', '.join(GRAMMAR_KEYS)} (got {', '.join(k for k, _ in given)})")
    return given[0] if given else None


def end_ids(generation_config: Any, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the generation config's end tokens, else the tokenizer's."""
    eos = generation_config.eos_token_id if generation_config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] bool from a bitmask [n, words]; tokens past the bitmask are not allowed."""
    bits = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros((bits.shape[0], vocab - bits.shape[1]))], dim=1)


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """An empty bitmask for `rows` positions over `vocab` tokens (CPU: llguidance fills it)."""
    return torch.zeros((rows, (vocab + 31) // 32), dtype=torch.int32)


def fill_bitmask(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of `bitmask`: the tokens `matcher` allows next."""
    from llguidance.torch import fill_next_token_bitmask

    fill_next_token_bitmask(matcher, bitmask, row)


class TokenGrammar:
    """Constraints compiled for one tokenizer whose model has `n_vocab` logits."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos_ids: set[int]):
        self.hf_tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None
        self._compiled: LRU[tuple[str, str], str] = LRU(COMPILED_GRAMMARS)
        """Recently compiled constraints (repeated schemas and forced calls are the common case)."""

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use."""
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self.hf_tokenizer, self.n_vocab, eos_token=self.eos_ids or None)
        return self._tokenizer

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
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"{key} is not a valid constraint: {'; '.join(messages)}")
        return grammar

    def new_matcher(self, key: str, value: str) -> Any:
        """A fresh matcher for one constraint, at the start of an output."""
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer, self.serialized(key, value))

    def replay(self, key: str, value: str, token_ids: Sequence[int]) -> torch.Tensor:
        """The bitmask [len(token_ids), words] of the tokens the constraint allowed before each of
        `token_ids`, an output sampled under it from its first token; GrammarError if the
        constraint does not compile or a token is not what it allowed."""
        matcher = self.new_matcher(key, value)
        bitmask = new_bitmask(len(token_ids), self.n_vocab)
        for i, token in enumerate(token_ids):
            fill_bitmask(matcher, bitmask, i)
            allowed = 0 <= token < self.n_vocab and int(bitmask[i, token >> 5]) >> (token & 31) & 1
            if not allowed or not matcher.consume_token(token):
                raise GrammarError(f"{key}: token {token} at output position {i} is not allowed: {matcher.get_error()}")
        return bitmask


_MODELS: LRU[str, TokenGrammar] = LRU(4)


def model_grammar(spec: str | Path) -> TokenGrammar:
    """The `TokenGrammar` of the model `spec` names (`models.resolve_model`): its tokenizer, its
    logits' width and its end tokens, as `Engine` builds it from the loaded model; built once.
    Loads no weights."""
    key = str(spec)
    grammar = _MODELS.get(key)
    if grammar is None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from flywheel.models.checkpoints import resolve_model

        path = resolve_model(spec)
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: transformers derives it from the config
            generation = GenerationConfig.from_model_config(config)
        grammar = _MODELS[key] = TokenGrammar(tokenizer, config.vocab_size, end_ids(generation, tokenizer))
    return grammar
