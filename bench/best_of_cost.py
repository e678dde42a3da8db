"""What serving the best of k replies costs (`memory.best_of`, flywheel/serve/best_of.py): latency
and throughput of the embedded engine answering with the best of k against one reply, in one run.

The best of k is, on the engine, k sampled replies of one request decoded at once and two
prefill-only scorings of each (the request's prompt and the prompt without the person's words);
the gateway's own work is the same either way and is left out: this drives the engine client
directly, as the gateway does. SmolLM2-135M (float32), the `shorter` instruction before the
bench's training questions, the app's sampling (temperature 0.7, 64 new tokens, a seed each);
the two ways alternate request by request so that the machine's drift falls on both.
    - **one at a time**: each request alone, median and 90th percentile of its latency;
    - **`--concurrency` at once**: requests in waves of that many, replies served a second.

    .venv/bin/python bench/best_of_cost.py        # bench/results/best_of_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from statistics import median, quantiles

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import machine, quiet_logs, table, write_result  # noqa: E402
from flywheel.drills.personal_agent import prompt_ids  # noqa: E402
from flywheel.bus.instructions import placed_before, without_request  # noqa: E402
from flywheel.drills.simulated_people import TRAIN_QUESTIONS  # noqa: E402
from flywheel.judge.wishes import ASPECTS  # noqa: E402
from flywheel.serve.best_of import BestOf  # noqa: E402

SHORTER = [ASPECTS["shorter"]]


class Asked:
    """One request's prompt, its engine bodies and its choice among k."""

    def __init__(self, tokenizer, question: str, seed: int, k: int, max_tokens: int):
        messages = [{"role": "user", "content": placed_before(SHORTER) + question}]
        ids = prompt_ids(tokenizer, messages)
        self.bodies = [{"input_ids": ids, "return_logprob": True, "rid": f"r{seed}+{j}",
                        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.7, "sampling_seed": seed + j}}
                       for j in range(k)]
        self.choosing = BestOf(k, ["shorter"], messages, ids, prompt_ids(tokenizer, without_request(messages, SHORTER)))

    async def answer(self, engine, best_of: bool) -> None:
        if best_of:
            await self.choosing.served(engine, self.bodies)
        else:
            await engine.generate(self.bodies[0])


async def measure(engine, asked: list[Asked], concurrency: int, rounds: int) -> dict:
    alone: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for i, request in enumerate(asked):
            for way in ((False, True) if (i + r) % 2 == 0 else (True, False)):
                started = time.perf_counter()
                await request.answer(engine, way)
                alone[way].append(time.perf_counter() - started)
    waves: dict[bool, float] = {False: 0.0, True: 0.0}
    for r in range(rounds):
        for start in range(0, len(asked), concurrency):
            wave = asked[start:start + concurrency]
            for way in ((False, True) if r % 2 == 0 else (True, False)):
                started = time.perf_counter()
                await asyncio.gather(*(request.answer(engine, way) for request in wave))
                waves[way] += time.perf_counter() - started
    served = rounds * len(asked)
    return {way: {"median_s": median(alone[way]), "p90_s": quantiles(alone[way], n=10)[-1],
                  "replies_per_s": served / waves[way]} for way in (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--name", default="best_of_cost")
    args = parser.parse_args()
    quiet_logs()
    from flywheel.models import load_model
    from flywheel.serve.backends.in_process import InProcessEngineClient
    from flywheel.serve.engine import Engine

    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer, max_batch_size=args.k * args.concurrency).start()
    try:
        questions = list(TRAIN_QUESTIONS)[:args.questions]
        asked = [Asked(tokenizer, q, 1000 * i, args.k, args.max_tokens) for i, q in enumerate(questions)]
        client = InProcessEngineClient(engine)
        asyncio.run(measure(client, asked[:2], args.concurrency, 1))  # warm-up
        got = asyncio.run(measure(client, asked, args.concurrency, args.rounds))
    finally:
        engine.stop()
    one, best = got[False], got[True]
    rows = [["one reply", *(round(one[key], 3) for key in ("median_s", "p90_s", "replies_per_s"))],
            [f"best of {args.k}", *(round(best[key], 3) for key in ("median_s", "p90_s", "replies_per_s"))],
            ["ratio", round(best["median_s"] / one["median_s"], 2), round(best["p90_s"] / one["p90_s"], 2),
             round(best["replies_per_s"] / one["replies_per_s"], 2)]]
    print(table(["", "alone: median s", "p90 s", f"{args.concurrency} at once: replies/s"], rows))
    path = write_result(args.name, {"args": vars(args), "machine": machine(None), "one": one, "best_of": best})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
