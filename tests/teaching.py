"""Teaching the `tiny` model one answer by a few supervised steps, for tests that need a model
that reliably produces something specific (a tool call, parallel calls), and serving it."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from flywheel.config import load_config
from flywheel.models import load_model, save_model
from flywheel.serve.loop import ServeLoop


def teach_tiny(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, answer: str, out_dir: Path,
               chat_template: str | None = None) -> str:
    """Train `tiny` until it answers `messages` (rendered with `tools`) with `answer` and its end
    token; returns the saved model's directory (its tokenizer carries `chat_template` if given)."""
    model, tokenizer = load_model("tiny")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    target = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    ids = torch.tensor([prompt_ids + target])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05
    return str(save_model(model.eval(), tokenizer, out_dir / "model"))


@contextlib.asynccontextmanager
async def serving(model: str, name: str, nats_url: str, run_dir: Path, *overrides: str) -> AsyncIterator[ServeLoop]:
    """A running serve loop for `model` (a path from `teach_tiny`), served as `name`."""
    loop = ServeLoop(load_config(None, [f"run_dir={run_dir}", "serve.port=0", f"model={model}",
                                        f"serve.served_model_name={name}", *overrides]), nats_url)
    await loop.start()
    try:
        yield loop
    finally:
        await loop.stop()
