"""Supervised fine-tuning on chat transcripts: a warm start before RL, e.g. on gold SWE
demonstrations (`flywheel swe demos`), so that a small model keeps to an agent's format
and sometimes solves a task, giving RL rewards above zero to learn from. `flywheel sft` runs it:

    flywheel sft --data DEMOS.jsonl --model smollm2-135m --out DIR [--epochs 1] [--lr 5e-5] [--batch 8]

`--data`: one JSON object per line with `messages` (OpenAI chat messages). Each conversation is
rendered by the model's chat template, message by message, so its tokens are the ones the
gateway would send; the loss is the mean cross-entropy of the assistant messages' tokens (the
rest is context). AdamW with a short warm-up and gradient clipping at 1.0, one optimizer step
per `--batch` conversations. The model and its tokenizer are saved to DIR, which a `model:`
setting (of `flywheel up`, `serve` or `train`) can then name.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch


def encode(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(token ids, labels) of a conversation: labels are the ids on assistant messages, -100 elsewhere."""
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for i, message in enumerate(messages, start=1):
        text = tokenizer.apply_chat_template(messages[:i], tokenize=False)
        if not text.startswith(rendered):
            raise ValueError("the chat template renders a conversation's start differently once it goes on")
        piece = tokenizer.encode(text[len(rendered):], add_special_tokens=False)
        rendered = text
        ids += piece
        labels += piece if message["role"] == "assistant" else [-100] * len(piece)
    return ids, labels


def fine_tune(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], epochs: int = 1, lr: float = 5e-5,
              batch: int = 8, warmup_steps: int = 5, seed: int = 0, log: Any = print) -> list[float]:
    """Train in place; returns the mean loss of each optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    order = list(range(len(examples)))
    losses: list[float] = []
    step_losses: list[float] = []
    started = time.monotonic()
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order)
        for k, index in enumerate(order, start=1):
            ids, labels = examples[index]
            loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
            (loss / batch).backward()
            step_losses.append(loss.item())
            if k % batch == 0 or k == len(order):
                for group in optimizer.param_groups:
                    group["lr"] = lr * min(1.0, (len(losses) + 1) / warmup_steps)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(sum(step_losses) / len(step_losses))
                step_losses = []
                log(f"epoch {epoch} step {len(losses)} loss {losses[-1]:.4f} ({time.monotonic() - started:.0f} s)")
    model.eval()
    return losses
