"""mini-swe-agent, installed as a real client, works an SWE task through the Flywheel endpoint in a
Flywheel sandbox, and its session must become one trajectory on the bus.

- The platform: a private nats-server, the serve loop (the real gateway and embedded engine on
  the chosen model) and the collect loop, in this process.
- The client: mini-swe-agent's own `mini` CLI from its own virtualenv
  (`flywheel.envs.swe.mini_swe_agent_venv`), unchanged: `mini.yaml` with its `LitellmModel` as
  `openai/<model>` (or, config `text`, `mini_textbased.yaml` with its `LitellmTextbasedModel`),
  `api_base` at the gateway and `extra_headers` carrying `X-Session-Id` / `X-Task-Id`, and
  `--environment-class flywheel.envs.swe.mini_swe_agent.MiniSweAgentEnvironment`, which opens a
  bubblewrap sandbox over the task's repository (`mini_swe_agent_task.prepare_task`).
- The episode's reward is the task's grade of the repository the agent left (or 0); posting it
  closes the session. The TRAFFIC stream must then hold exactly `api_calls` turns, all of that
  session, and the TRAJECTORY stream exactly one trajectory, of that session, holding all of them.

`bench/mini_swe_agent.py` runs it and keeps the report; tests/test_mini_swe_agent.py runs it small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from flywheel.envs.swe.mini_swe_agent_task import SLOT, episode_reward, prepare_task
from flywheel.envs.swe.mini_swe_agent_venv import MSA_VENV, msa_env

ADAPTER = "flywheel.envs.swe.mini_swe_agent.MiniSweAgentEnvironment"


# mini-swe-agent's two stock configurations: actions as tool calls (`mini.yaml`, litellm's
# function calling), or as a fenced ```mswea_bash_command block in the text (`mini_textbased.yaml`
# with its `litellm_textbased` model class, for models without tool calling).
CONFIGS = {"tool": ["-c", "mini.yaml"], "text": ["-c", "mini_textbased.yaml", "--model-class", "litellm_textbased"]}


def mini_argv(url: str, model: str, session: str, task: dict[str, Any], steps: int, max_tokens: int, out: Path,
              config: str = "tool") -> list[str]:
    """The stock `mini` command line: only configuration, no code of ours but the environment."""
    headers = {"X-Session-Id": session, "X-Task-Id": task["instance_id"]}
    return [
        str(MSA_VENV / "bin" / "mini"), "-m", f"openai/{model}", "-t", task["problem_statement"],
        "-y", "--exit-immediately", "-o", str(out), "--environment-class", ADAPTER,
        *CONFIGS[config],
        "-c", f"agent.step_limit={steps}", "-c", "agent.cost_limit=0",
        "-c", "model.cost_tracking=ignore_errors",
        "-c", f"model.model_kwargs.api_base={url}/v1", "-c", "model.model_kwargs.api_key=flywheel",
        "-c", f"model.model_kwargs.extra_headers={json.dumps(headers)}",
        "-c", f"model.model_kwargs.max_tokens={max_tokens}", "-c", "model.model_kwargs.temperature=1.0",
        "-c", f"environment.workdir={task['workdir']}", "-c", "environment.backend=bubblewrap",
        "-c", f"environment.slot={SLOT}", "-c", "environment.timeout=60",
        "-c", f"environment.readonly={json.dumps(task['readonly'])}",
        "-c", f"environment.env={json.dumps(task['env'])}",
    ]


async def run_mini(argv: list[str], home: Path, log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run the client (killed after `timeout_s`), its output to `log_path`: (exit code, seconds)."""
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT, env=msa_env(home), cwd=str(home))
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
    return proc.returncode, time.monotonic() - started


async def bus_records(nats_url: str, session: str, want_turns: int, wait_s: float = 20.0) -> dict[str, Any]:
    """Every turn and trajectory on the bus (this run's private nats-server): ours and any other."""
    from flywheel.bus import TRAFFIC_SUBJECTS, TRAJECTORY_SUBJECT, Bus, Trajectory, Turn

    bus = await Bus.connect(nats_url, name="bench-msa")
    turns: list[Turn] = []
    trajectories: list[Trajectory] = []
    try:
        turn_consumer = bus.consumer(TRAFFIC_SUBJECTS, "msa-turns")
        traj_consumer = bus.consumer(TRAJECTORY_SUBJECT, "msa-trajectories")

        async def pull() -> None:
            turns.extend(d.record for d in await turn_consumer.fetch(timeout_s=0.5) if isinstance(d.record, Turn))
            trajectories.extend(d.record for d in await traj_consumer.fetch(timeout_s=0.5)
                                if isinstance(d.record, Trajectory))

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not (
                len(turns) >= want_turns and any(t.session_id == session for t in trajectories)):
            await pull()
        await asyncio.sleep(1.0)  # anything arriving late (a stray second trajectory) is counted too
        await pull()
    finally:
        await bus.close()
    return {"turns": turns, "trajectories": trajectories}


def summarize(session: str, records: dict[str, Any], mini_traj: dict[str, Any]) -> dict[str, Any]:
    """The checks of what the bus holds against the client's own trajectory file, and the trajectory."""
    turns, trajectories = records["turns"], records["trajectories"]
    api_calls = mini_traj.get("info", {}).get("model_stats", {}).get("api_calls")
    ours = [t for t in trajectories if t.session_id == session]
    traj = ours[0] if ours else None
    system_prompt = next((m["content"] for m in mini_traj.get("messages", []) if m.get("role") == "system"), None)
    checks = {
        "client_made_model_calls": bool(api_calls),
        "every_turn_carries_the_session": bool(turns) and all(t.session_id == session for t in turns),
        "turns_on_bus_equal_api_calls": len(turns) == api_calls,
        "exactly_one_trajectory": len(trajectories) == 1 and len(ours) == 1,
        "trajectory_holds_every_turn": traj is not None and sorted(t.id for t in traj.turns) == sorted(t.id for t in turns),
        "turns_are_mini_swe_agents_requests": bool(turns) and all(  # its system prompt opens every request
            t.messages and t.messages[0].get("role") == "system" and t.messages[0].get("content") == system_prompt
            for t in turns),
        "sampled_tokens_in_trajectory": traj is not None and traj.num_sampled_tokens > 0,
    }
    out: dict[str, Any] = {"checks": checks, "ok": all(checks.values()), "api_calls": api_calls,
                           "turns_on_bus": len(turns), "trajectories_on_bus": len(trajectories),
                           "sessions_seen": sorted({t.session_id for t in turns})}
    if traj is not None:
        out["trajectory"] = {
            "id": traj.id, "session_id": traj.session_id, "task_id": traj.task_id, "close_reason": traj.close_reason,
            "turns": len(traj.turns), "segments": len(traj.segments), "sampled_tokens": traj.num_sampled_tokens,
            "tokens": sum(len(s.token_ids) for s in traj.segments), "reward": [e.reward for e in traj.feedback],
            "per_turn": [{"turn_index": t.turn_index, "messages": len(t.messages), "finish_reason": t.finish_reason,
                          "reply": (t.response.get("content") or "")[:120]} for t in traj.turns],
        }
    return out


async def endpoint_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run of the `mini` CLI through a fresh platform under `work`, as `args` say (`model`,
    `steps`, `max_tokens`, `timeout`, `config`: tool or text, `grade`): what it did, what the bus
    holds, and `checks` / `ok`."""
    import httpx

    from flywheel.bus import EmbeddedNats
    from flywheel.collect.loop import CollectLoop
    from flywheel.config import load_config
    from flywheel.serve.loop import ServeLoop

    task, swe_task = prepare_task(work)
    session = f"msa-{uuid.uuid4().hex[:12]}"
    nats = EmbeddedNats(work / "nats")
    nats_url = nats.start()
    try:
        config = load_config(None, [f"run_dir={work / 'run'}", "serve.port=0", f"model={args.model}",
                                    "collect.feedback_grace_s=0"])
        serve, collect = ServeLoop(config, nats_url), CollectLoop(config, nats_url)
        url = await serve.start()
        await collect.start()
        try:
            mini_out = work / "mini.traj.json"
            argv = mini_argv(url, serve.model_name, session, task, args.steps, args.max_tokens, mini_out, args.config)
            rc, wall = await run_mini(argv, work, work / "mini.log", args.timeout)
            log_tail = (work / "mini.log").read_text(errors="replace")[-3000:]
            mini_traj = json.loads(mini_out.read_text()) if mini_out.exists() else {}
            reward, grading = 0.0, {"graded": False}
            if args.grade and swe_task is not None:
                reward, grading = await asyncio.to_thread(episode_reward, swe_task, Path(task["workdir"]))
            async with httpx.AsyncClient() as http:  # the episode is over: its reward closes the session
                response = await http.post(f"{url}/v1/sessions/{session}/feedback",
                                           json={"reward": reward, "source": "bench"})
                response.raise_for_status()
            api_calls = mini_traj.get("info", {}).get("model_stats", {}).get("api_calls") or 1
            records = await bus_records(nats_url, session, api_calls)
        finally:
            await collect.stop()
            await serve.stop()
    finally:
        nats.stop()
    info = mini_traj.get("info", {})
    tool_messages = [m for m in mini_traj.get("messages", []) if m.get("role") == "tool"]
    return {
        "task": {k: task[k] for k in ("source", "instance_id", "problem_statement")},
        "session_id": session, "reward": reward, "grading": grading,
        "mini_returncode": rc, "mini_wall_s": round(wall, 2),
        "mini_argv": [a if not a.startswith("environment.env=") else "environment.env=<task env>" for a in argv[1:]],
        "mini": {"exit_status": info.get("exit_status"), "api_calls": info.get("model_stats", {}).get("api_calls"),
                 "mini_version": info.get("mini_version"), "model_type": info.get("config", {}).get("model_type"),
                 "environment_type": info.get("config", {}).get("environment_type"),
                 "commands_executed": len(tool_messages), "messages": len(mini_traj.get("messages", []))},
        **summarize(session, records, mini_traj),
        **({} if rc == 0 else {"mini_log_tail": log_tail}),
    }
