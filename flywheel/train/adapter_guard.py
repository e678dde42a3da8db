"""What protects a person from a harmful version of their own adapter: a version is published only
if the adapter still answers general prompts as the base does (`adapters.guard_drop`) and its
replies still answer the question asked (`adapters.guard_answers`).

A user's adapter is theirs alone and no gate compares it with anything: the versions their own
corrections make go straight to them. One-sample steps can erode a model into replies that
answer nothing (issue 45's full fine-tuning run, word salad by version 20), and an adapter can
do the same to its one user. So before an adapter's version is published the trainer measures:
- forgetting: the base's own greedy answers to `GENERAL_PROMPTS` (arithmetic, facts, code, plain
  instructions: nothing a personal preference should change much), and the mean log-probability
  per token the adapter gives those answers, against the base's;
- answering: the adapter's own greedy replies to `RELEVANCE_PROMPTS`, and how much better each
  fits its own question than the next one as the base reads it (its relevance: the pointwise
  mutual information of reply and question, nats a token); a reply answers when that is at
  least half the mean of its reference's replies. Erosion shows here first: replies that speak
  of something else, a canned line, "as a chatbot I cannot...", a list of nothing, while the
  base's answers stay likely. The questions are asked where the adapter is used: after the
  system messages the last conversation of its person's it trained on began with, and after the
  instructions the served memory put before that conversation's first question (`context_of`,
  `memory.placement: user`; at the end of the system message they are in it already); the
  trainer keeps them per adapter, in memory only: a restarted trainer asks bare until its next
  step. Practice replies, asked as the judge chose (`judge.teacher.practice_prompt: bare`), are
  not where it is used and set no context. What an
  adapter learns under its user's system message it erodes there first: an unscripted person's
  adapter (personal-agent bench, `name` trial 2) answered 7 of 8 questions asked bare and, after
  "You are Arthur's personal assistant.", 5 of the 7 the base answers there (the person's rule
  on held-out questions: 0.67).
Each against its origin's (a user's adapter that started from its tenant's is not held back
for what that one changed). A drop above `guard_drop`, or fewer than `guard_answers` of the
questions the origin answers, holds the version back: it is not published, the adapter's weights
go back to its last published version (its origin's, or the base's, before any) and its
optimizer starts afresh, and the loop's stats count it (`held_back`). The person keeps being
served what they had.

The base's answers are computed once, at the first check, as one batch (SmolLM2 on 2 CPU
cores: 9.2-9.7 s; one prompt at a time it took 31 s), and its replies' relevance once per context
(4.8 s there; the `CONTEXTS` most recent kept); a check is a batched forward pass over the answers (2.0 s there) and the adapter's
32-token replies to eight questions with their scoring (5.3 s there); a user's adapter whose
tenant's adapter is in memory has that one's measured too, once for each of its revisions
(`AdapterSet.revision`) and context.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from statistics import mean
from typing import Any, NamedTuple

import torch

from flywheel.bus import Turn
from flywheel.bus.instructions import placed_before
from flywheel.bus.messages import content_text
from flywheel.lru import LRU
from flywheel.train.adapters import AdapterSet

log = logging.getLogger(__name__)

GENERAL_PROMPTS = (
    "What is 17 plus 25?",
    "What is 9 times 8?",
    "What is the capital of France?",
    "How many days are there in a week?",
    "Name three primary colors.",
    "Write a Python function that returns the square of a number.",
    "What does the HTML tag <p> stand for?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Which planet is closest to the sun?",
    "Spell the word 'garden' backwards.",
)
ANSWER_TOKENS = 24
RELEVANCE_PROMPTS = (
    "How do I unclog a slow bathroom sink?",
    "What should I look for when buying a used car?",
    "How can I get better at speaking in public?",
    "What is a simple way to organise a messy closet?",
    "How do I ask my manager for more time on a deadline?",
    "What are some tips for running my first 5k race?",
    "How do I keep bread from going stale so fast?",
    "How can I start saving a little money each month?",
)
"""Everyday questions that ask for a few sentences (none of them the personal-agent bench's): what
one-sample steps toward a person's wish erode first is whether replies answer them at all."""
REPLY_TOKENS = 32
RELEVANT = 0.5
"""Mean relevance (nats a token) below which a reference's replies are taken not to answer at all."""
CONTEXTS = 64
"""The most contexts whose base replies' relevance is kept (a deployment of many system prompts
measures the others again when they come back)."""
CONTEXT_CHARS = 2000
"""The most characters of an adapter's system messages its check asks after (the first ones)."""


class Context(NamedTuple):
    """Where an adapter's questions are asked: the system messages its conversations begin with
    (its user's or agent's), in order, and what the served memory puts before the first question."""

    system: tuple[str, ...] = ()
    before: str = ""


class AdapterGuard:
    def __init__(self, adapters: AdapterSet, tokenizer, max_drop: float | None, min_answers: float | None = None,
                 prompts: tuple[str, ...] = GENERAL_PROMPTS, questions: tuple[str, ...] = RELEVANCE_PROMPTS):
        self.adapters, self.tokenizer, self.prompts, self.questions = adapters, tokenizer, prompts, questions
        self.max_drop, self.min_answers = max_drop, min_answers
        self._batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.base_logprob: float | None = None
        self.base_relevance: LRU[Context, list[float]] = LRU(CONTEXTS)
        """The base's replies' relevance, by context."""
        self.held_back: dict[str, int] = {}
        self._origins: LRU[tuple[str, str, Context], tuple[int, Any]] = LRU(2 * CONTEXTS)
        """(what, origin, context) -> the origin's revision and what was measured of it then."""

    def drop(self, name: str, origin: str | None = None) -> float:
        """How much less likely (nats a token, mean) `name` makes the base's answers than the base
        does, or than `origin` does when that adapter is here (what `name` started from: a user's
        adapter is measured against its tenant's, not held back for what that one changed)."""
        ids, attention, answer = self._reference()
        reference = self.base_logprob
        if self._here(name, origin):
            def measure() -> float:
                self.adapters.activate(origin)
                return _mean_logprob(self.adapters.model, ids, attention, answer)
            reference = self._of_origin(("logprob", origin, Context()), measure)
        self.adapters.activate(name)
        return reference - _mean_logprob(self.adapters.model, ids, attention, answer)

    def answers_kept(self, name: str, origin: str | None = None, context: Context = Context()) -> float:
        """The share of the questions its reference answers that `name` still answers, each asked
        after the system messages `context`: the reference is `origin` when that adapter is here,
        else the base. A reply answers when it fits its question at least half as well as the
        reference's replies fit theirs on average (`relevance`); 1.0 where the reference does not
        answer these questions at all (mean relevance below `RELEVANT`: the random test model), as
        there is nothing to keep."""
        if self._here(name, origin):
            reference = self._of_origin(("relevance", origin, context), lambda: self.relevance(origin, context))
        else:
            reference = self.relevance(None, context)
        if mean(reference) < RELEVANT:
            return 1.0
        bar = mean(reference) / 2
        answered = sum(r >= bar for r in self.relevance(name, context))
        return answered / sum(r >= bar for r in reference)

    def allows(self, name: str, origin: str | None = None, context: Context = Context()) -> bool:
        """Whether `name`'s current weights may be published (and count it when not); its replies
        are asked for in `context`, the system messages its conversations begin with (an adapter
        is used there, and what it learned there is what it may have eroded: an adapter trained
        under "You are Arthur's personal assistant." answered 7 of 8 questions asked bare, and 5
        of the 7 the base answers after that line)."""
        if self.max_drop is not None and (drop := self.drop(name, origin)) > self.max_drop:
            return self._held(name, "it makes the base's general answers %.2f nats a token less likely "
                              "(adapters.guard_drop %.2f)", drop, self.max_drop)
        if self.min_answers is not None and (kept := self.answers_kept(name, origin, context)) < self.min_answers:
            return self._held(name, "its replies answer %.2f of the everyday questions they answered "
                              "(adapters.guard_answers %.2f)", kept, self.min_answers)
        return True

    def relevance(self, name: str | None, context: Context = Context()) -> list[float]:
        """How much better each reply `name` writes (greedy; None: the base, computed once for
        each context) to `questions` (`RELEVANCE_PROMPTS`), asked after the system messages
        `context`, fits its own question than the next one, as the base reads it (nats a token)."""
        if name is not None:
            return self.relevance_of(self.replies(name, context), context)
        known = self.base_relevance.get(context)
        if known is None:
            known = self.base_relevance[context] = self.relevance_of(self.replies(None, context), context)
        return known

    def relevance_of(self, replies: list[list[int]], context: Context = Context()) -> list[float]:
        """For each of `replies` (token ids, one for each of `questions`, in order),
        log p_base(reply | its question) - log p_base(reply | the next question), per token: the
        pointwise mutual information of reply and question. An answer to the question scores
        well above 0 (SmolLM2's own: 1.3-2.0); a reply that would do for any question (word
        salad, a canned line, "as a chatbot I cannot...", a reply to something else) near or
        below it. Each question asked after the system messages `context`."""
        questions = self._questions(context)
        n = len(questions)
        own = [q + r for q, r in zip(questions, replies)]
        other = [questions[(i + 1) % n] + r for i, r in enumerate(replies)]
        ids, attention, marks = _right_padded(own + other, [len(r) for r in replies] * 2)
        with torch.no_grad(), self.adapters.disabled() as base:
            device = next(base.parameters()).device
            logp = _token_logprobs(base, ids.to(device), attention.to(device))
        marks = marks[:, 1:].to(device)
        per_reply = (logp * marks).sum(-1) / marks.sum(-1)
        return (per_reply[:n] - per_reply[n:]).tolist()

    def replies(self, name: str | None, context: Context = Context()) -> list[list[int]]:
        """`name`'s greedy replies to `questions` asked after the system messages `context`, each
        cut after its end-of-sequence token."""
        if name is not None:
            self.adapters.activate(name)
        context_manager = self.adapters.disabled() if name is None else contextlib.nullcontext(self.adapters.model)
        with context_manager as model:
            return self._greedy(model, self._questions(context), REPLY_TOKENS)

    def _greedy(self, model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """`model`'s greedy continuations of `prompts`, generated as one left-padded batch, each cut
        after its end-of-sequence token."""
        width = max(map(len, prompts))
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        pad = eos if pad is None else pad
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            device = next(model.parameters()).device
            out = model.generate(ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        return [row[:row.index(eos) + 1] if eos in row else row for row in out[:, width:].tolist()]

    def forget_contexts(self) -> None:
        """Drop everything measured in a context (a forgotten person's system messages are its keys;
        what is needed again is measured again)."""
        self.base_relevance = LRU(CONTEXTS)
        self._origins = LRU(2 * CONTEXTS)

    def _of_origin(self, key: tuple[str, str, Context], measure: Callable[[], Any]) -> Any:
        """`measure()` of the adapter `key` names (what: its reference log-probability or relevance;
        the origin; the context), made again only when its weights have changed since (a tenant's
        adapter is the origin of each of its users' checks)."""
        origin = key[1]
        known = self._origins.get(key)
        if known is None or known[0] != self.adapters.revision(origin):
            value = measure()
            known = self._origins[key] = (self.adapters.revision(origin), value)
        return known[1]

    def _held(self, name: str, why: str, *values: float) -> bool:
        self.held_back[name] = self.held_back.get(name, 0) + 1
        log.warning("adapter %s held back: " + why, name, *values)
        return False

    def _here(self, name: str, origin: str | None) -> bool:
        return origin is not None and origin != name and origin in self.adapters

    def _questions(self, context: Context = Context()) -> list[list[int]]:
        return [self._chat(q, context) for q in self.questions]

    def _chat(self, prompt: str, context: Context = Context()) -> list[int]:
        # one system message: every chat template takes one
        system = [{"role": "system", "content": "\n\n".join(context.system)}] if context.system else []
        messages = [*system, {"role": "user", "content": context.before + prompt}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts with the base's greedy answers, right-padded: ids, attention mask, and the
        answer tokens' mask (the base's mean log-probability of them is `base_logprob`)."""
        if self._batch is not None:
            return self._batch
        prompts = [self._chat(prompt) for prompt in self.prompts]
        with self.adapters.disabled() as base:
            answers = self._greedy(base, prompts, ANSWER_TOKENS)
            rows = [prompt + answer for prompt, answer in zip(prompts, answers)]
            device = next(base.parameters()).device
            self._batch = tuple(t.to(device) for t in _right_padded(rows, list(map(len, answers))))
            self.base_logprob = _mean_logprob(base, *self._batch)
        return self._batch


def context_of(turn: Turn) -> Context:
    """Where `turn` was asked: the system (or developer) messages its request begins with, as text,
    at most `CONTEXT_CHARS` of it all (a check asks 24 rows after it: an agent's long system prompt
    would multiply its cost), and the instructions the served memory put before the text of its
    first user message (`Turn.instructions`, `memory.placement: user`)."""
    lines, left = [], CONTEXT_CHARS
    for message in turn.messages:
        if message.get("role") not in ("system", "developer") or left <= 0:
            break
        lines.append(content_text(message.get("content"))[:left])
        left -= len(lines[-1])
    first = next((m for m in turn.messages if m.get("role") == "user"), None)
    before = placed_before(turn.instructions) if turn.instructions else ""
    placed = first is not None and content_text(first.get("content")).startswith(before)
    return Context(tuple(lines), before if placed else "")


def _right_padded(rows: list[list[int]], tails: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rows` right-padded: ids, attention mask, and the mask of each row's last `tails` tokens."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    marks = torch.zeros_like(ids, dtype=torch.bool)
    for r, (row, n) in enumerate(zip(rows, tails)):
        marks[r, len(row) - n:len(row)] = True
    return ids, attention, marks


def _token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability given the ones before it (one column fewer than `ids`)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _mean_logprob(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, answer: torch.Tensor) -> float:
    """Mean log-probability of the tokens `answer` marks, each given the ones before it."""
    with torch.no_grad():
        logp = _token_logprobs(model, ids, attention)
    return float(logp[answer[:, 1:]].mean())
