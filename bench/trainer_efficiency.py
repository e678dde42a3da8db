"""Evidence 4, "the trainer wastes nothing": `flywheel.train.trainer.Trainer.step` against a bare torch
loop on the same model and the same micro-batches, and packing against padding.

Workload: `--samples` single-segment samples with heavy-tailed lengths (prompts of 30-200
tokens, outputs drawn from 8..256 with weights 32:16:8:4:2:1, as in the engine benchmark),
random token ids, behaviour logprobs of -1, advantages ±1.

- *bare*: for each micro-batch, `model(input_ids, position_ids).logits`, log-softmax at the
  tokens, a policy-gradient loss (−A·logp over the mask, token mean), backward; then gradient
  clipping and `AdamW.step()`: the least a training step can do.
- *trainer*: `Trainer.step` on the same micro-batches with `actor.use_decoupled_loss=false` (the
  same passes as *bare*: one forward and one backward per micro-batch), and also with the
  decoupled loss (one more no-grad forward for π_prox: work the algorithm asks for, reported
  apart).
- *packing vs padding*: `Trainer.step` on the packed micro-batches and on padded ones (one
  segment per row, rows padded to their micro-batch's longest) of the same samples, same token
  budget: real (non-padding) tokens per second.

Each variant runs `--repeats` steps after one warm-up step, in one process, with
`--threads` torch threads; the median step time counts. Target: trainer/bare >= 0.9.

    .venv/bin/python bench/trainer_efficiency.py                          # tiny
    .venv/bin/python bench/trainer_efficiency.py --model smollm2-135m --samples 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    CpuWatch,
    machine,
    quiet_logs,
    table,
    wait_quiet,
    write_result,
)
from bench.lib.workload import training_rows  # noqa: E402
from flywheel.config import load_config  # noqa: E402
from flywheel.models import load_model  # noqa: E402
from flywheel.train.packing import MicroBatch, micro_batches  # noqa: E402
from flywheel.train.trainer import Trainer  # noqa: E402


def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[MicroBatch]) -> None:
    optimizer.zero_grad(set_to_none=True)
    total = float(sum(b.loss_mask.sum() for b in batches))
    for b in batches:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                       use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(2, b.input_ids[:, 1:, None]).squeeze(2)
        loss = -(b.advantages[:, 1:] * logp * b.loss_mask[:, 1:]).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def timed(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4096, help="train.micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quiet_logs()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model, tokenizer = load_model(args.model)
    rows = training_rows(args.samples, len(tokenizer), args.seed)
    packed = micro_batches(rows, args.budget, pad_id=0, packing=True)
    padded = micro_batches(rows, args.budget, pad_id=0, packing=False)
    real = sum(len(r) for r in rows)

    def trainer(*overrides: str) -> Trainer:
        config = load_config(None, [f"train.micro_batch_tokens={args.budget}", "actor.ppo_n_minibatches=1", *overrides])
        return Trainer(model, config.actor, config.train)

    wait_quiet()
    watch = CpuWatch().start()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    plain, decoupled = trainer("actor.use_decoupled_loss=false", "actor.recompute_logprobs=false"), trainer()
    seconds = {
        "bare (packed)": timed(lambda: bare_step(model, optimizer, packed), args.repeats),
        "trainer, standard PPO (packed)": timed(lambda: plain.step([packed]), args.repeats),
        "trainer, decoupled PPO (packed)": timed(lambda: decoupled.step([packed]), args.repeats),
        "trainer, standard PPO (padded)": timed(lambda: plain.step([padded]), args.repeats),
    }
    cpu = watch.stop()
    computed = {"padded": sum(b.computed_tokens for b in padded), "packed": sum(b.computed_tokens for b in packed)}
    rows_out = [[name, s, real / s, computed["padded" if "padded" in name else "packed"]] for name, s in seconds.items()]
    print(table(["variant", "step s (median)", "real tokens/s", "computed tokens"], rows_out))
    ratio = seconds["bare (packed)"] / seconds["trainer, standard PPO (packed)"]
    packing_gain = seconds["trainer, standard PPO (padded)"] / seconds["trainer, standard PPO (packed)"]
    print(f"trainer / bare: {ratio:.3f} (target >= 0.9); packed vs padded: {packing_gain:.2f}x real tokens/s; "
          f"padding computes {computed['padded'] / real:.2f}x the real tokens; foreign cores {cpu['foreign_cores']}")
    write_result(f"trainer_efficiency_{args.model}", {
        "args": vars(args), "machine": machine(args.threads), "real_tokens": real, "computed_tokens": computed,
        "micro_batches": {"packed": len(packed), "padded": len(padded)}, "step_s": seconds,
        "trainer_over_bare": ratio, "packed_over_padded": packing_gain, "cpu": cpu,
    })


if __name__ == "__main__":
    main()
