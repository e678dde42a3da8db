"""What protects a person from a harmful version of their own adapter (`adapters.guard_drop`): a
version is published only if the adapter still answers general prompts as the base does.

A user's adapter is theirs alone and no gate compares it with anything: the versions their own
corrections make go straight to them. One-sample steps can erode a model into replies that
answer nothing (issue 45's full fine-tuning run, word salad by version 20), and an adapter can
do the same to its one user. So before an adapter's version is published the trainer measures
forgetting: the base's own greedy answers to `GENERAL_PROMPTS` (arithmetic, facts, code, plain
instructions: nothing a personal preference should change much), and the mean log-probability
per token the adapter gives those answers, against the base's (against its origin's, for a
user's adapter that started from its tenant's). A drop above `guard_drop` nats a
token holds the version back: it is not published, the adapter's weights go back to its last
published version (its origin's, or the base's, before any) and its optimizer starts afresh,
and the loop's stats count it (`held_back`). The person keeps being served what they had.

The base's answers are computed once, at the first check (27 s for SmolLM2 on 2 CPU cores); a
check is one batched forward pass over them with the adapter on (2.0 s there).
"""

from __future__ import annotations

import logging

import torch

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


class AdapterGuard:
    def __init__(self, adapters: AdapterSet, tokenizer, max_drop: float, prompts: tuple[str, ...] = GENERAL_PROMPTS):
        self.adapters, self.tokenizer, self.max_drop, self.prompts = adapters, tokenizer, max_drop, prompts
        self._batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.base_logprob: float | None = None
        self.held_back: dict[str, int] = {}

    def drop(self, name: str, origin: str | None = None) -> float:
        """How much less likely (nats a token, mean) `name` makes the base's answers than the base
        does, or than `origin` does when that adapter is here (what `name` started from: a user's
        adapter is measured against its tenant's, not held back for what that one changed)."""
        ids, attention, answer = self._reference()
        reference = self.base_logprob
        if origin is not None and origin != name and origin in self.adapters:
            self.adapters.activate(origin)
            reference = _mean_logprob(self.adapters.model, ids, attention, answer)
        self.adapters.activate(name)
        return reference - _mean_logprob(self.adapters.model, ids, attention, answer)

    def allows(self, name: str, origin: str | None = None) -> bool:
        """Whether `name`'s current weights may be published (and count it when not)."""
        drop = self.drop(name, origin)
        if drop <= self.max_drop:
            return True
        self.held_back[name] = self.held_back.get(name, 0) + 1
        log.warning("adapter %s held back: it makes the base's general answers %.2f nats a token less likely "
                    "(adapters.guard_drop %.2f)", name, drop, self.max_drop)
        return False

    def _reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts with the base's greedy answers, right-padded: ids, attention mask, and the
        answer tokens' mask (the base's mean log-probability of them is `base_logprob`)."""
        if self._batch is not None:
            return self._batch
        rows, answers = [], []
        with torch.no_grad(), self.adapters.disabled() as base:
            device = next(base.parameters()).device
            for prompt in self.prompts:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                          tokenize=False)
                prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
                out = base.generate(torch.tensor([prompt_ids], device=device),
                                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                                    max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
                rows.append(out[0].tolist())
                answers.append(len(out[0]) - len(prompt_ids))
            width = max(map(len, rows))
            ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
            attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
            answer = torch.zeros_like(ids, dtype=torch.bool)
            for r, (row, n) in enumerate(zip(rows, answers)):
                answer[r, len(row) - n:len(row)] = True
            self._batch = ids.to(device), attention.to(device), answer.to(device)
            self.base_logprob = _mean_logprob(base, *self._batch)
        return self._batch


def _mean_logprob(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, answer: torch.Tensor) -> float:
    """Mean log-probability of the tokens `answer` marks, each given the ones before it."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return float(logp[answer[:, 1:]].mean())
