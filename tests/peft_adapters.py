"""PEFT adapters of `tiny` for the adapter tests: random ones, made and saved in PEFT's format
(`random_adapters`), on every linear layer (`LINEAR`) or those a test names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from flywheel.models import load_model

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
