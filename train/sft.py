"""Supervised fine-tuning on chat transcripts: a warm start before RL, e.g. on gold SWE
demonstrations (`python -m envs.swe demos`), so that a small model keeps to an agent's format
and sometimes solves a task, giving RL rewards above zero to learn from.

    python -m train.sft --data DEMOS.jsonl --model smollm2-135m --out DIR [--epochs 1] [--lr 5e-5] [--batch 8]

`--data`: one JSON object per line with `messages` (OpenAI chat messages). Each conversation is
rendered by the model's chat template, message by message, so its tokens are the ones the
gateway would send; the loss is the mean cross-entropy of the assistant messages' tokens (the
rest is context). AdamW with a short warm-up and gradient clipping at 1.0, one optimizer step
per `--batch` conversations. The model and its tokenizer are saved to DIR, which a `model:`
setting (or `serve`, or `train.run`) can then name.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from models import load_model, save_model


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    examples = [encode(tokenizer, json.loads(line)["messages"]) for line in Path(args.data).read_text().splitlines() if line]
    if not examples:
        parser.error(f"{args.data} holds no conversations")
    print(f"{len(examples)} conversations, {sum(len(ids) for ids, _ in examples)} tokens")
    fine_tune(model, examples, args.epochs, args.lr, args.batch)
    print(f"saved to {save_model(model, tokenizer, Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
