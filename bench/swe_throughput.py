"""Environment-parallel SWE throughput: episodes per minute at 1, 2, 4 and 8 parallel
environments, with a scripted agent and with the model.

- scripted: each episode opens a task's sandbox, runs k - 2 exploration commands (`ls`, `grep`,
  `cat`), applies the gold patch with one command, submits, and is graded by the task's tests:
  the environment side alone (sandbox commands, materialization, test runs), on Ray workers,
  one per slot. Every episode must grade 1.0.
- model: the rollout driver's own pool (`flywheel.rollout.env_pool.RayEnvPool`) running episodes of
  `--max-turns` turns through the real endpoint (`tiny`, embedded engine, turns recorded to a
  private nats-server), graded like any episode.

    .venv/bin/python bench/swe_throughput.py                      # tiny task set, ~5 min
    .venv/bin/python bench/swe_throughput.py --tasks runs/swe_tasks/tasks.jsonl --episodes 32
    .venv/bin/python bench/swe_throughput.py --modes model --model smollm2-135m --parallel 2 \
        --model-episodes 32 --max-turns 8 --max-new-tokens 192        # does SmolLM2 ever fix one?

Writes bench/results/swe_throughput.json (swe_throughput_<model>.json for another model).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import (  # noqa: E402
    machine,
    median,
    percentile,
    quiet_logs,
    table,
    write_result,
)

SCRIPT = ("ls", "grep -rn 'def ' --include=*.py . | head -20", "cat setup.cfg pyproject.toml 2>/dev/null | head -40")


@ray.remote(num_cpus=0)
class ScriptedWorker:
    """One slot: plays the scripted agent on whatever task it is handed."""

    def __init__(self, env_args: dict[str, Any], slot: int):
        from flywheel.envs import make_env

        self.env, self.slot = make_env("swe", env_args), slot

    def episode(self, seed: int, k: int) -> dict[str, Any]:
        from flywheel.envs.swe.agent import SUBMIT_MARKER

        started = time.monotonic()
        task = self.env.reset(random.Random(seed))
        record = self.env.tasks[task.info["instance_id"]]
        episode = self.env.open(task, self.slot)
        opened = time.monotonic()
        try:
            commands = [*(SCRIPT * k)][: max(0, k - 2)]
            commands += [f"git apply <<'PATCH'\n{record.patch}PATCH", f"echo {SUBMIT_MARKER}"]
            for command in commands:
                episode.step(f"```bash\n{command}\n```")
            acted = time.monotonic()
            grade = episode.finish()
        finally:
            episode.close()
        done = time.monotonic()
        return {"reward": grade.reward, "open_s": opened - started, "act_s": acted - opened, "grade_s": done - acted,
                "total_s": done - started}


def scripted(parallel: int, episodes: int, k: int, env_args: dict[str, Any]) -> dict[str, Any]:
    workers = [ScriptedWorker.remote(env_args, slot) for slot in range(parallel)]
    ray.get([w.__ray_ready__.remote() for w in workers])
    started = time.monotonic()
    pending = {workers[i].episode.remote(i, k): i for i in range(min(parallel, episodes))}
    results, next_seed = [], len(pending)
    while pending:
        [ready], _ = ray.wait(list(pending))
        slot = pending.pop(ready)
        results.append(ray.get(ready))
        if next_seed < episodes:
            pending[workers[slot].episode.remote(next_seed, k)] = slot
            next_seed += 1
    wall = time.monotonic() - started
    for w in workers:
        ray.kill(w)
    return summarize(results, wall)


async def with_model(parallel: int, episodes: int, args: argparse.Namespace, env_args: dict[str, Any]) -> dict[str, Any]:
    from bench.lib.served import Served
    from flywheel.envs import make_env
    from flywheel.rollout.env_pool import RayEnvPool

    overrides = ["rollout.env=swe", f"rollout.n_parallel_envs={parallel}", f"rollout.episode.max_turns={args.max_turns}",
                 f"rollout.sampling.max_new_tokens={args.max_new_tokens}", f"rollout.max_concurrent_rollouts={max(parallel, 1)}",
                 f"rollout.sampling.temperature={args.temperature}",
                 "serve.torch_threads=1"]  # the environments' workers share the machine (docs/experiments/swe-environments.md measured it so)
    async with Served(args.model, overrides) as served:
        config = served.config.model_copy(update={"rollout": served.config.rollout.model_copy(update={"env_args": env_args})})
        pool = RayEnvPool(config, served.url, served.loop.model_name)
        env = make_env("swe", env_args)
        rng = random.Random(0)
        listed = [env.task(record, f"-{i}") for i, record in enumerate(env.tasks.values())] if args.instances else None
        episodes = len(listed) if listed else episodes
        started = time.monotonic()

        running = asyncio.Semaphore(parallel)  # an episode's time, not its wait for a slot

        async def one(i: int) -> dict[str, Any]:
            async with running:
                t0 = time.monotonic()
                result = await pool.run(listed[i] if listed else env.reset(rng), f"bench-{parallel}-{i}")
                return {"instance": result.details.get("instance_id"), "reward": result.reward, "turns": result.turns, "end": result.end, "total_s": time.monotonic() - t0,
                        "commands": result.details.get("commands"), "submitted": result.details.get("submitted")}

        results = await asyncio.gather(*(one(i) for i in range(episodes)))
        wall = time.monotonic() - started
        await pool.close()
    return summarize(results, wall)


def summarize(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Rates and latencies; the 1-minute load average says how busy the machine was (Ray's
    workers are not this process's children, so per-process accounting would miss them)."""
    totals = [r["total_s"] for r in results]
    summary = {"episodes": len(results), "wall_s": wall, "episodes_per_min": 60 * len(results) / wall,
               "episode_s_p50": median(totals), "episode_s_p95": percentile(totals, 95),
               "rewards": [r["reward"] for r in results], "loadavg_1m": os.getloadavg()[0]}
    if results and "commands" in results[0]:  # model runs: what the policy did
        summary["episodes_detail"] = [{k: r[k] for k in ("instance", "turns", "end", "commands", "submitted")} for r in results]
    for key in ("open_s", "act_s", "grade_s"):
        if results and key in results[0]:
            summary[f"{key}_p50"] = median([r[key] for r in results])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", help="tasks.jsonl (default: the tiny set that ships with Flywheel)")
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--parallel", default="1,2,4,8")
    parser.add_argument("--episodes", type=int, default=16, help="per parallelism level, scripted")
    parser.add_argument("--model-episodes", type=int, default=8, help="per parallelism level, with the model")
    parser.add_argument("--k", type=int, default=5, help="scripted agent's commands per episode")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="the policy for the model runs (tiny, smollm2-135m)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", default="scripted,model")
    parser.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    parser.add_argument("--instances", help="a file of instance ids: the model runs work each once, in order")
    parser.add_argument("--name", help="result file name, beginning swe_throughput (default: swe_throughput[_MODEL])")
    args = parser.parse_args()
    quiet_logs()
    env_args: dict[str, Any] = {"difficulty": [args.difficulty], "slot_base": 200}  # clear of the tests' slots
    if args.tasks:
        env_args["tasks"] = os.path.abspath(args.tasks)
    if args.instances:
        env_args["instances"] = Path(args.instances).read_text().split()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    levels = [int(p) for p in args.parallel.split(",")]
    runs: dict[str, dict[int, dict[str, Any]]] = {"scripted": {}, "model": {}}
    modes = args.modes.split(",")
    for n in levels if "scripted" in modes else []:
        runs["scripted"][n] = scripted(n, args.episodes, args.k, env_args)
        assert all(r == 1.0 for r in runs["scripted"][n]["rewards"]), "a scripted gold episode did not resolve its task"
    for n in levels if "model" in modes else []:
        runs["model"][n] = asyncio.run(with_model(n, args.model_episodes, args, env_args))
    ray.shutdown()
    rows = [[mode, n, f"{r['episodes_per_min']:.1f}", f"{r['episode_s_p50']:.2f}", f"{r['episode_s_p95']:.2f}",
             f"{r.get('grade_s_p50', float('nan')):.2f}", f"{r['loadavg_1m']:.1f}"]
            for mode, by_n in runs.items() for n, r in by_n.items()]
    print(table(["agent", "parallel", "episodes/min", "episode p50 s", "p95 s", "grade p50 s", "load 1m"], rows))
    name = args.name or ("swe_throughput" if args.model == "tiny" else f"swe_throughput_{args.model}")
    write_result(name, {"machine": machine(None), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
