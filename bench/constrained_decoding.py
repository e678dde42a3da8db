"""What constrained decoding costs per token in the embedded engine.

What it measures
    B requests at once (the same prompt, temperature 1, distinct seeds), each generating exactly
    T tokens, in one `serve.engine.Engine`:

    - free: no constraint, `ignore_eos` (every request runs to T tokens);
    - json: `json_schema` = an object with one free string field, the way a forced tool call's
      arguments or a `response_format` answer are decoded: the grammar keeps the (untrained)
      model inside the string, so every request also runs to T tokens, and every token pays for
      the llguidance mask (computed on the engine thread, then applied to the logits).

    Reported per batch size: wall ms per decode step and per token of each, and the extra
    cost of the constraint per token, absolute (µs) and relative to the free run measured in
    the same process right before it (median of `--repeats` alternating runs). The first
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
import time

from bench._common import git_commit, machine, median, quiet_logs, table, wait_quiet, write_result

SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                     "x-guidance": {"whitespace_flexible": False}})


async def run(engine, prompt: list[int], batch: int, tokens: int, constrained: bool, seed: int) -> tuple[float, int]:
    from serve.engine.sampling import SamplingParams

    def params(i: int) -> SamplingParams:
        raw = {"max_new_tokens": tokens, "temperature": 1.0, "sampling_seed": seed * 1000 + i}
        raw.update({"json_schema": SCHEMA} if constrained else {"ignore_eos": True})
        return SamplingParams.from_dict(raw)

    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(prompt, params(i)) for i in range(batch)))
    return time.perf_counter() - start, sum(len(r.output_ids) for r in results)


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

    from models import load_model
    from serve.engine import Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(model, tokenizer, max_batch_size=max(batches)).start()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the weather."}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    first = time.perf_counter()
    await run(engine, prompt, 1, 2, True, 0)  # builds the vocabulary view
    setup_s = time.perf_counter() - first
    wait_quiet(max_wait_s=60)
    rows, results = [], []
    for batch in batches:
        timings: dict[str, list[float]] = {"free": [], "json": []}
        counts: dict[str, int] = {}
        for repeat in range(args.repeats):
            for mode in ("free", "json"):
                seconds, produced = await run(engine, prompt, batch, args.tokens, mode == "json", repeat)
                timings[mode].append(seconds)
                counts[mode] = produced
        free, constrained = median(timings["free"]), median(timings["json"])
        per_token = {mode: median(timings[mode]) / counts[mode] for mode in timings}
        extra_us = (per_token["json"] - per_token["free"]) * 1e6
        result = {"batch": batch, "tokens_per_request": args.tokens, "free_s": free, "json_s": constrained,
                  "tokens": counts, "ms_per_step": {m: median(timings[m]) / args.tokens * 1e3 for m in timings},
                  "extra_us_per_token": extra_us, "ratio": constrained / free}
        results.append(result)
        rows.append([batch, f"{result['ms_per_step']['free']:.2f}", f"{result['ms_per_step']['json']:.2f}",
                     f"{extra_us:.0f}", f"{result['ratio']:.2f}x", f"{counts['json']}/{batch * args.tokens}"])
    engine.stop()
    print(table(["B", "free ms/step", "json ms/step", "extra µs/token", "json / free", "json tokens"], rows))
    print(f"first constrained request (builds llguidance's vocabulary view): {setup_s * 1e3:.0f} ms")
    path = write_result(f"constrained_decoding_{args.model}", {
        "commit": git_commit(), "machine": machine(args.threads), "model": args.model, "schema": SCHEMA,
        "first_request_s": setup_s, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
