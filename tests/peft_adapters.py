"""PEFT adapters of `tiny` for the adapter tests: random ones made and saved in PEFT's format
(`random_adapters`), and what the engine's adapter tests share: four of them (ranks differ, one on
attention only, one another's next version), the prompts and greedy parameters they are asked
with, the log-prob tolerance, and a started engine of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from flywheel.models import load_model, place
from flywheel.serve.engine import Engine, SamplingParams

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of `tiny` but the output head."""


def random_adapters(root: Path, specs: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, tuple[Path, Any]]:
    """{name: (directory, its PEFT model)}: for each `name: (seed, LoraConfig arguments)`, a PEFT
    adapter of `tiny` with random (not zero) B, saved in PEFT's format under `root/name`."""
    made = {}
    for name, (seed, arguments) in specs.items():
        base, _ = load_model("tiny")
        torch.manual_seed(seed)
        peft = get_peft_model(base, LoraConfig(init_lora_weights=False, **arguments)).eval()
        peft.save_pretrained(root / name)
        made[name] = (root / name, peft)
    return made


ADAPTERS = {  # name: (seed, LoraConfig arguments); ranks differ, so the table pads
    "alice": (1, dict(r=4, lora_alpha=8, target_modules=LINEAR)),
    "bob": (2, dict(r=16, lora_alpha=16, use_rslora=True, target_modules=LINEAR)),
    "carol": (3, dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"])),  # attention only, an odd rank
    "alice-v2": (4, dict(r=8, lora_alpha=8, target_modules=LINEAR)),  # alice's next version
}
TOL = 2e-4  # a batched decode step's log-prob against one full forward pass, in float32
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
TEXTS = ["Write some digits.", "hi", "What is 12 + 7? Answer with the number only.", "Name a colour, please, any one."]


def root_of(adapters):
    """The directory all the test adapters are in (an engine's `lora_root`)."""
    return adapters["alice"][0].parent


def fresh_engine(root=None, device="cpu", dtype=torch.float32, **options) -> Engine:
    """A started engine on a tiny model of its own on `device` (adapters found under `root`, if given)."""
    model, tokenizer = load_model("tiny", dtype)
    return Engine(place(model, device), tokenizer, lora_root=str(root) if root else None,
                  **{"max_batch_size": 8, **options}).start()
