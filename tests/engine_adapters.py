"""What the embedded engine's adapter tests share (`test_engine_lora.py`,
`test_engine_adapter_slots.py`): four PEFT adapters of `tiny` (ranks differ, one on attention
only, one another's next version; the `engine_adapters` fixture makes them), the prompts and
greedy parameters they are asked with, the log-prob tolerance, and a started engine of its own."""

from __future__ import annotations

import torch

from flywheel.models import load_model, place
from flywheel.serve.engine import Engine, SamplingParams

from peft_adapters import LINEAR

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
