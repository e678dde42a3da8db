"""Seeded synthetic workloads shared by the benchmarks: chat prompts of varied length and a
heavy-tailed distribution of output lengths; for the trainer, single-segment samples of such
lengths."""

from __future__ import annotations

import random
from typing import Any

from flywheel.bus import Segment
from flywheel.train.packing import Row

WORDS = (
    "the model reads a question and writes an answer with digits only please count from one to ten "
    "what is two plus three tell me a short story about a cat who learns to add numbers quickly "
    "explain why the sky looks blue during the day and red at sunset in plain words for a child "
    "list four colours then name a fruit for each of them and say which one you like the best"
).split()

# Prompt sizes in words, and how often each occurs.
PROMPT_WORDS = (4, 16, 48, 120, 240)
PROMPT_WEIGHTS = (3, 4, 3, 2, 1)


def user_message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids exactly as the gateway makes them (`flywheel.serve.prompts.PromptBuilder.chat`)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def mixed_requests(tokenizer: Any, n: int, lengths: list[int], weights: list[float], seed: int) -> list[dict[str, Any]]:
    """n requests in arrival order: {"messages", "prompt_ids", "max_new_tokens"}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(PROMPT_WORDS, PROMPT_WEIGHTS)[0]
        messages = [{"role": "user", "content": user_message(rng, words)}]
        out.append({
            "messages": messages,
            "prompt_ids": render(tokenizer, messages),
            "max_new_tokens": rng.choices(lengths, weights)[0],
        })
    return out


def uniform_requests(tokenizer: Any, n: int, seed: int, shortest: int = 16, longest: int = 256) -> list[dict[str, Any]]:
    """`mixed_requests`' chat prompts, each asking for a length drawn uniformly from [shortest,
    longest] (`bench/engines.py`'s workload, also `bench/engine_step.py --part run`'s)."""
    rng = random.Random(seed)
    return [dict(r, max_new_tokens=rng.randint(shortest, longest)) for r in mixed_requests(tokenizer, n, [16], [1], seed)]


TRAINING_OUTPUT_LENGTHS, TRAINING_OUTPUT_WEIGHTS = [8, 16, 32, 64, 128, 256], [32, 16, 8, 4, 2, 1]


def training_rows(n: int, vocab: int, seed: int) -> list[Row]:
    """n single-segment samples for `Trainer.step` (`bench/trainer_efficiency.py`'s workload):
    prompts of 30-200 random tokens, outputs of heavy-tailed length, behaviour log-probs of -1,
    advantages alternately -1 and +1."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, output = rng.randint(30, 200), rng.choices(TRAINING_OUTPUT_LENGTHS, TRAINING_OUTPUT_WEIGHTS)[0]
        ids = [rng.randrange(vocab) for _ in range(prompt + output)]
        mask = [0] * prompt + [1] * output
        segment = Segment(token_ids=ids, loss_mask=mask, logprobs=[-1.0 * m for m in mask], versions=[0 * m for m in mask])
        sign = 1.0 if i % 2 else -1.0
        rows.append(Row(segment, [sign * m for m in mask]))
    return rows
