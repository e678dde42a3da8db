"""What constrained decoding costs per token in the embedded engine.

What it measures
    B requests at once (the same prompt, temperature 1, distinct seeds), each generating exactly
    T tokens, in one `flywheel.serve.engine.Engine`:

    - json: `json_schema` = an object with one free string field, the way a forced tool call's
      arguments or a `response_format` answer are decoded, up to T tokens; every token pays for
      the llguidance mask (computed on the engine thread, then applied to the logits). A model
      may finish the object early.
    - free: the same requests without a constraint, each made to generate exactly as many
      tokens as its constrained twin did (`ignore_eos`, `max_new_tokens` = that length), so both
      runs do the same model work.

    Reported per batch size: wall ms per generated token of each, and the extra cost of the
    constraint per token, absolute (µs) and relative (median of `--repeats` runs, each a json
    run then its free twin, in the same process). The first
    constrained request, which builds llguidance's view of the vocabulary, is warmed up and not
    timed; that one-off cost is reported separately.

How to run (from the repository root)
    .venv/bin/python -m bench.constrained_decoding                       # tiny, B = 1, 8, 32
    .venv/bin/python -m bench.constrained_decoding --model smollm2-135m --batches 1,8
    Writes bench/results/constrained_decoding_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    git_commit,
    machine,
    median,
    quiet_logs,
    table,
    wait_quiet,
    write_result,
)

SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                     "x-guidance": {"whitespace_flexible": False}})


async def run(engine, prompt: list[int], lengths: list[int], constrained: bool, seed: int) -> tuple[float, list[int]]:
    """One request per entry of `lengths` (its token budget), all at once; (seconds, tokens each)."""
    from flywheel.serve.engine.sampling import SamplingParams

    def params(i: int, length: int) -> SamplingParams:
        raw = {"max_new_tokens": length, "temperature": 1.0, "sampling_seed": seed * 1000 + i}
        raw.update({"json_schema": SCHEMA} if constrained else {"ignore_eos": True})
        return SamplingParams.from_dict(raw)

    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(prompt, params(i, n)) for i, n in enumerate(lengths)))
    return time.perf_counter() - start, [len(r.output_ids) for r in results]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    quiet_logs()
    import torch

    from flywheel.models import load_model
    from flywheel.serve.engine import Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(model, tokenizer, max_batch_size=max(batches)).start()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the weather."}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    first = time.perf_counter()
    await run(engine, prompt, [2], True, 0)  # builds the vocabulary view
    setup_s = time.perf_counter() - first
    wait_quiet(max_wait_s=60)
    rows, results = [], []
    for batch in batches:
        timings: dict[str, list[float]] = {"free": [], "json": []}
        produced = 0
        for repeat in range(args.repeats):
            seconds, lengths = await run(engine, prompt, [args.tokens] * batch, True, repeat)
            timings["json"].append(seconds / sum(lengths))
            seconds, twins = await run(engine, prompt, lengths, False, repeat)
            assert twins == lengths
            timings["free"].append(seconds / sum(lengths))
            produced += sum(lengths)
        per_token = {mode: median(values) for mode, values in timings.items()}
        extra_us = (per_token["json"] - per_token["free"]) * 1e6
        result = {"batch": batch, "max_tokens": args.tokens, "tokens_per_repeat": produced / args.repeats,
                  "ms_per_token": {m: v * 1e3 for m, v in per_token.items()}, "extra_us_per_token": extra_us,
                  "ratio": per_token["json"] / per_token["free"]}
        results.append(result)
        rows.append([batch, f"{per_token['free'] * 1e3:.3f}", f"{per_token['json'] * 1e3:.3f}", f"{extra_us:.0f}",
                     f"{result['ratio']:.2f}x", f"{produced / args.repeats:.0f}"])
    engine.stop()
    print(table(["B", "free ms/token", "json ms/token", "extra µs/token", "json / free", "tokens per run"], rows))
    print(f"first constrained request (builds llguidance's vocabulary view): {setup_s * 1e3:.0f} ms")
    path = write_result(f"constrained_decoding_{args.model}", {
        "commit": git_commit(), "machine": machine(args.threads), "model": args.model, "schema": SCHEMA,
        "first_request_s": setup_s, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
