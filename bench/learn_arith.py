"""Evidence 1, "it learns": SmolLM2-135M's greedy accuracy on held-out arithmetic before and
after a `flywheel train` of at most `--minutes` on this CPU.

1. *Before*: the base model answers the environment's fixed held-out problems (never drawn for
   training, see flywheel/envs/arithmetic.py), greedy, through the embedded engine with the chat
   template applied as the gateway does; scored by the environment's verifier.
2. *Training*: `flywheel train --config configs/arith_smollm2.yaml` in a fresh
   `run_dir`, stopped (SIGTERM, which saves a final checkpoint) when `--minutes` are up unless
   it reaches `train.max_steps` first. Extra `key=value` arguments go to it.
3. *After*: the same evaluation with the newest checkpoint's weights.

Writes bench/results/learn_arith.json (accuracies, per-problem answers, the run's summary) and
docs/img/learn_arith.png (the reward curve).

    .venv/bin/python bench/learn_arith.py                 # ~35 min: 30 of training, 2 x ~2 of evaluation
    .venv/bin/python bench/learn_arith.py --minutes 5 --problems 50 train.max_steps=10   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, machine, quiet_logs, wait_quiet, write_result  # noqa: E402
from flywheel.cli import command
from flywheel.config import load_config  # noqa: E402
from flywheel.envs import make_env  # noqa: E402
from flywheel.models import load_model, load_weights  # noqa: E402
from flywheel.serve.engine import Engine, SamplingParams  # noqa: E402
from flywheel.train.checkpoint import Checkpoints  # noqa: E402
from flywheel.train.plot import plot_runs  # noqa: E402

CONFIG = "configs/arith_smollm2.yaml"


async def accuracy(weights: Path | None, model_name: str, env, n: int, max_new_tokens: int) -> dict:
    """Greedy accuracy of the model (base, or with `weights` loaded) on the first `n` held-out problems."""
    model, tokenizer = load_model(model_name)
    if weights is not None:
        load_weights(model, weights)
    tasks = env.held_out(n)
    engine = Engine(model, tokenizer, max_batch_size=64).start()
    try:
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False) for t in tasks]
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
                                         for p in prompts))
        elapsed = time.perf_counter() - started
    finally:
        engine.stop()
    answers = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
    scores = [env.verify(t, a) for t, a in zip(tasks, answers)]
    return {"accuracy": sum(scores) / len(scores), "problems": len(tasks), "eval_s": elapsed,
            "examples": [{"question": t.messages[0]["content"], "expected": t.answer, "answer": a, "score": s}
                         for t, a, s in zip(tasks, answers, scores)]}


def train(run_dir: Path, minutes: float, overrides: list[str]) -> dict:
    argv = [*command("train"), "--config", CONFIG, "--refresh-s", "10", f"run_dir={run_dir}", *overrides]
    child = subprocess.Popen(argv, cwd=ROOT)
    try:
        child.wait(timeout=minutes * 60)
        stopped_early = False
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGTERM)  # flywheel train stops the loops; the trainer saves a checkpoint
        child.wait(timeout=300)
        stopped_early = True
    summary = run_dir / "summary.json"
    return {"returncode": child.returncode, "stopped_by_time_limit": stopped_early,
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="training time limit")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems to evaluate")
    parser.add_argument("--run-dir", default="runs/bench_learn_arith")
    parser.add_argument("--name", default="learn_arith", help="results go to bench/results/NAME.json and docs/img/NAME.png (NAME begins learn_arith)")
    parser.add_argument("--reuse-run", action="store_true",
                        help="skip training: evaluate the newest checkpoint of an existing --run-dir")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="passed to flywheel train")
    args = parser.parse_args()
    quiet_logs()
    config = load_config(CONFIG, args.overrides)
    env = make_env(config.rollout.env, config.rollout.env_args)
    run_dir = ROOT / args.run_dir
    if not args.reuse_run:
        shutil.rmtree(run_dir, ignore_errors=True)

    wait_quiet()
    before = asyncio.run(accuracy(None, config.model, env, args.problems, config.rollout.sampling.max_new_tokens))
    print(f"before: {before['accuracy']:.3f} on {before['problems']} held-out problems", flush=True)
    summary = run_dir / "summary.json"
    run = {"reused": True, "summary": json.loads(summary.read_text()) if summary.exists() else None} if args.reuse_run \
        else train(run_dir, args.minutes, args.overrides)
    checkpoint = Checkpoints(run_dir / "checkpoints", keep=1).latest()
    after = asyncio.run(accuracy(checkpoint, config.model, env, args.problems, config.rollout.sampling.max_new_tokens))
    print(f"after:  {after['accuracy']:.3f} ({checkpoint.name})", flush=True)

    curve = ROOT / "docs" / "img" / f"{args.name}.png"
    curve.parent.mkdir(parents=True, exist_ok=True)
    plot_runs({"SmolLM2-135M, η=4": run_dir / "metrics.jsonl"}, curve, title="SmolLM2-135M on arithmetic (flywheel train)")
    result = {"args": vars(args), "machine": machine(config.train.torch_threads), "before": before, "after": after,
              "gain_points": 100 * (after["accuracy"] - before["accuracy"]), "checkpoint": checkpoint.name, "run": run}
    path = write_result(args.name, result)
    print(f"gain: {result['gain_points']:+.1f} points; results: {path}; curve: {curve}")


if __name__ == "__main__":
    main()
