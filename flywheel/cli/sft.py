"""`flywheel sft --data DEMOS.jsonl --model MODEL --out DIR`: supervised fine-tuning on chat
transcripts, a warm start before RL (`flywheel/train/sft.py`)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = ("Fine-tune MODEL on the assistant messages of DEMOS.jsonl (one `{\"messages\": [...]}` per "
                          "line) and save it to DIR, which `model:` can then name.")
    parser.add_argument("--data", required=True, help="JSON lines, each with `messages`")
    parser.add_argument("--model", required=True, help="tiny, smollm2-135m or a model directory")
    parser.add_argument("--out", required=True, help="where the fine-tuned model is saved")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=8, help="conversations per optimizer step")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from flywheel.models import load_model, save_model
    from flywheel.train.sft import encode, fine_tune

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    examples = [encode(tokenizer, json.loads(line)["messages"]) for line in Path(args.data).read_text().splitlines() if line]
    if not examples:
        args.parser.error(f"{args.data} holds no conversations")
    print(f"{len(examples)} conversations, {sum(len(ids) for ids, _ in examples)} tokens")
    fine_tune(model, examples, args.epochs, args.lr, args.batch)
    print(f"saved to {save_model(model, tokenizer, Path(args.out))}")
    return 0
