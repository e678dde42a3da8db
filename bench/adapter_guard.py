"""Calibrating the adapter guard (flywheel/train/adapter_guard.py, `adapters.guard_drop` and
`guard_answers`): how far its two measures (the drop in log-probability of the base's own
general answers; the share of the everyday questions the base answers that the adapter's
greedy replies still answer) move as an
adapter grows from what training made it to far past that, against general skill measured
directly (greedy held-out arithmetic, bench/learn_arith.py's evaluation) and the share of replies
that still answer an everyday question as the simulated person sees it (its own rule,
flywheel/drills/simulated_people.py `answers`, on the bench's held-out questions).

Each adapter given (a directory of the adapter store, `run_dir/adapters/NAME`: its newest
version) is scaled: its LoRA B matrices times s, the update times s (s = 1 is the adapter as
trained; larger s stands for training pushed further in the same direction). For each s: the
guard's drop, arithmetic accuracy and answer share of the base with that update merged in.

    .venv/bin/python bench/adapter_guard.py runs/bench_unscripted/both-*-0/adapters/*   # bench/results/adapter_guard.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import table, write_result  # noqa: E402

SCALES = (1.0, 3.0, 10.0, 30.0)


def newest(adapter_dir: Path) -> Path:
    return max(adapter_dir.glob("v*"), key=lambda p: int(p.name[1:]))


@functools.cache
def guard_for(stored: str, model_name: str):
    """A trainer's adapters and a guard for adapters of the stored configuration, made once: the
    base's answers and relevance are computed at its first check and kept."""
    from flywheel.config import load_config
    from flywheel.models import load_model
    from flywheel.train.adapter_guard import AdapterGuard
    from flywheel.train.trainer import Trainer

    lora = json.loads(stored)
    config = load_config(None, ["adapters.kind=lora", f"model={model_name}", f"adapters.rank={lora['r']}",
                                f"adapters.alpha={lora['lora_alpha']}",
                                f"adapters.target_modules={json.dumps(lora['target_modules'])}"])
    model, tokenizer = load_model(model_name)
    adapters = Trainer(model, config.actor, config.train, config.adapters).adapters
    return adapters, AdapterGuard(adapters, tokenizer, max_drop=1.0, min_answers=0.8)


def measure(version_dir: Path, scale: float, args) -> dict:
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    from bench.lib.personal_eval import satisfaction
    from bench.personal_agent import arithmetic
    from flywheel.drills.simulated_people import HELD_OUT_QUESTIONS, PREFERENCES, User
    from flywheel.models import load_model
    from flywheel.models.lora_adapter import CONFIG_FILE, WEIGHTS_FILE

    tensors = {k: v * scale if "lora_B" in k else v for k, v in load_file(version_dir / WEIGHTS_FILE).items()}
    stored = (version_dir / CONFIG_FILE).read_text()  # the adapter's own rank, alpha and layers
    adapters, guard = guard_for(stored, args.model)
    adapters.ensure("probe")
    adapters.load("probe", tensors)
    checks = {"adapter": str(version_dir), "scale": scale, "drop": guard.drop("probe"),
              "answers_kept": guard.answers_kept("probe"), "relevance": guard.relevance("probe")}
    if not args.skill:
        return checks
    with tempfile.TemporaryDirectory() as tmp:
        scaled, merged = Path(tmp) / "adapter", Path(tmp) / "merged"
        scaled.mkdir()
        (scaled / CONFIG_FILE).write_text((version_dir / CONFIG_FILE).read_text())
        save_file({k: v.contiguous() for k, v in tensors.items()}, scaled / WEIGHTS_FILE)
        base, _ = load_model(args.model)
        PeftModel.from_pretrained(base, str(scaled)).merge_and_unload().save_pretrained(merged)
        arith = arithmetic(str(merged), args)
        person = User("Maya", PREFERENCES["brief"], seed=0)
        replies = asyncio.run(satisfaction(merged, args.model, person, HELD_OUT_QUESTIONS, args))
    return {**checks, "arithmetic": arith, "answers": replies["answers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("adapters", nargs="+", type=Path, help="adapter store directories (run_dir/adapters/NAME)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--arith-problems", type=int, default=30)
    parser.add_argument("--heldout-samples", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--overrides", nargs="*", default=[], help="(satisfaction's: unused without a hint)")
    parser.add_argument("--no-skill", dest="skill", action="store_false",
                        help="the guard's measures alone (seconds a row), not arithmetic and answers (minutes)")
    parser.add_argument("--name", default="adapter_guard", help="bench/results/NAME.json")
    args = parser.parse_args()
    rows = []
    for adapter in args.adapters:
        for scale in SCALES:
            rows.append(measure(newest(adapter), scale, args))
            print(rows[-1], flush=True)
    print(table(["adapter", "scale", "guard drop (nats/token)", "answers kept", "arithmetic", "answers"],
                [[Path(r["adapter"]).parent.parent.parent.name, r["scale"], r["drop"], r["answers_kept"],
                  r.get("arithmetic"), r.get("answers")] for r in rows]))
    write_result(args.name, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
