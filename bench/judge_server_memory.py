"""What a judge server costs, which adapters save (issue 44): with `adapters.kind: lora` the
policy's base (a request with no adapter) is the judge's frozen teacher, and no judge server
starts (`FlywheelConfig.base_teaches`).

Measured in a fresh process each: the resident memory of Python with the engine's libraries
imported, then after loading the model and starting the embedded engine as a judge server does
(`flywheel.serve.loop.embedded_engine`, the serve defaults) and answering one scoring request
(a prefill-only request, as the teacher sends). A judge server is a process of its own (a Ray
actor under `flywheel up`), so all of its resident memory is saved, not only the model's.

How to run (from the repository root)
    .venv/bin/python bench/judge_server_memory.py [--model smollm2-135m] [--dtype float32]

Writes bench/results/judge_server_memory_<model>_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, START_COMMIT  # noqa: E402

PROBE = """
import asyncio, json, sys, psutil, torch
from flywheel.config import load_config
from flywheel.models import load_model
from flywheel.serve.engine import SamplingParams
from flywheel.serve.loop import embedded_engine
process = psutil.Process()
imported = process.memory_info().rss
config = load_config(None, [f"model={sys.argv[1]}", f"serve.dtype={sys.argv[2]}"])
model, tokenizer = load_model(config.model, getattr(torch, config.serve.dtype))
engine = embedded_engine(model.eval(), tokenizer, config.serve)
prompt = tokenizer.encode("Score this reply, which the policy sampled a moment ago. " * 8)
async def score():
    return await engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=1.0))
asyncio.run(score())
print(json.dumps({"imported_mb": imported / 2**20, "serving_mb": process.memory_info().rss / 2**20,
                  "parameters_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}))
engine.stop()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    done = subprocess.run([sys.executable, "-c", PROBE, args.model, args.dtype], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"model": args.model, "dtype": args.dtype, "commit": START_COMMIT, **found,
              "saved_mb": found["serving_mb"], "model_and_engine_mb": found["serving_mb"] - found["imported_mb"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"judge_server_memory_{args.model}_{args.dtype}.json").write_text(json.dumps(result, indent=2))
    print(f"a judge server ({args.model}, {args.dtype}): {found['serving_mb']:.0f} MB resident, of which "
          f"{result['model_and_engine_mb']:.0f} MB model and engine ({found['parameters_mb']:.0f} MB of parameters); "
          f"with adapters none starts")


if __name__ == "__main__":
    main()
