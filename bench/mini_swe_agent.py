"""Evidence 4 (issue 13): mini-swe-agent, installed as a real client, works an SWE task through
the Flywheel endpoint in a Flywheel sandbox, and its session becomes one trajectory on the bus.

- The platform: a private nats-server, the serve loop (the real gateway and embedded engine on
  `--model`, default `tiny`) and the collect loop, in this process.
- The client: mini-swe-agent 2.4.6's own `mini` CLI from its own virtualenv (`make msa-venv`:
  `.venv-msa`; through litellm it pins `openai<3` and `huggingface-hub<2`, so it cannot share
  Flywheel's venv), unchanged: `mini.yaml` with its `LitellmModel` as `openai/<model>` (or,
  `--config text`, `mini_textbased.yaml` with its `LitellmTextbasedModel`),
  `api_base` at the gateway and `extra_headers` carrying `X-Session-Id` / `X-Task-Id`, and
  `--environment-class envs.swe.mini_swe_agent.MiniSweAgentEnvironment`, which opens a
  bubblewrap sandbox over the task's repository (the first task of the checked-in tiny SWE
  task set), with the configuration's own prompts. The model's replies are not scripted;
  tiny's are random text without an action, so each step is a format error that
  mini-swe-agent sends back, until `--steps` model calls.
- The episode's reward is the task's grade of the repository the agent left (`flywheel.envs.swe.grade`);
  posting it closes the session. The TRAFFIC stream must then hold exactly `api_calls` turns,
  all of that session (every request carried the header), and the TRAJECTORY stream exactly
  one trajectory, of that session, holding all of them.
- Protocol check (scripted, separate from the above): mini-swe-agent's `DefaultAgent` with its
  `DeterministicModel` drives the same kind of sandbox through the adapter: commands run as the
  slot's uid in the repository, without network, statelessly, and the submit marker raises
  mini-swe-agent's own `Submitted` with the diff as the submission.

    make msa-venv                                   # once
    .venv/bin/python bench/mini_swe_agent.py [--config tool|text] [--steps 3] [--max-tokens 48] [--model tiny]

Result: bench/results/mini_swe_agent.json (other models: mini_swe_agent_<model>.json; the text
configuration: ..._text.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MSA_VENV = Path(os.environ.get("FLYWHEEL_MSA_VENV", ROOT / ".venv-msa"))
ADAPTER = "flywheel.envs.swe.mini_swe_agent.MiniSweAgentEnvironment"
SLOT = 40  # the sandbox uid is the uid base (10000) + slot: far from the slots tests and rollouts use


def msa_available() -> str:
    """'' when mini-swe-agent's venv is usable, else why not."""
    if not (MSA_VENV / "bin" / "mini").exists():
        return f"no {MSA_VENV}/bin/mini: create it with `make msa-venv`"
    return ""


def msa_env(home: Path) -> dict[str, str]:
    """The client's environment: quiet, no first-run prompt, no network lookups, fail fast."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"), "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "TERM": "dumb", "COLUMNS": "160"}


# ---- the task -------------------------------------------------------------------------------

def prepare_task(work: Path) -> tuple[dict[str, Any], Any]:
    """(what the client needs, the `SweTask` or None): the first task of the tiny SWE task set,
    materialized under `work`; a small repository with one bug when the task set is missing."""
    from flywheel.envs.sandbox.bubblewrap import interpreter_prefixes
    from flywheel.envs.swe.testenv import sandbox_spec

    work.mkdir(parents=True, exist_ok=True)
    workdir = work / "repo"
    task = None
    try:
        from flywheel.envs.swe import TINY_TASKS, load_tasks, materialize

        task = load_tasks(TINY_TASKS)[0]
        materialize(task, workdir)
        info = {"source": str(TINY_TASKS.relative_to(ROOT)), "instance_id": task.instance_id,
                "problem_statement": task.problem_statement, "pythonpath": task.pythonpath}
    except (ImportError, FileNotFoundError, IndexError) as e:
        task = None
        workdir.mkdir(parents=True)
        (workdir / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        (workdir / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
        git = ["git", "-c", "user.name=flywheel", "-c", "user.email=flywheel@localhost"]
        subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
        subprocess.run([*git, "add", "-A"], cwd=workdir, check=True)
        subprocess.run([*git, "commit", "-qm", "base"], cwd=workdir, check=True)
        info = {"source": f"fallback repository ({type(e).__name__}: {e})", "instance_id": "fallback__calc-1",
                "problem_statement": "add(2, 3) returns -1 instead of 5.", "pythonpath": "."}
    spec = sandbox_spec(workdir, info["pythonpath"], timeout_s=60)
    # The task's `python` is this process's venv: expose its interpreter too, whatever the
    # client's venv was made from (the backend binds only the opening process's interpreter).
    readonly = [str(p) for p in (*spec.readonly, *interpreter_prefixes())]
    return {**info, "workdir": str(workdir), "env": spec.env, "readonly": list(dict.fromkeys(readonly))}, task


def episode_reward(task: Any, workdir: Path) -> tuple[float, dict[str, Any]]:
    """The task's grade of what the agent left in the repository (the tiny set's `grade`)."""
    from flywheel.envs.sandbox import make_backend
    from flywheel.envs.swe import grade
    from flywheel.envs.swe.gitstore import working_diff

    diff = working_diff(workdir)
    result = grade(task, diff, make_backend("bubblewrap"), SLOT)
    return result.reward, {"diff_chars": len(diff), "resolved": result.details.get("resolved"),
                           "reason": result.details.get("reason"), "stats": result.details.get("stats")}


# ---- the real client through the endpoint ---------------------------------------------------

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


# ---- scripted protocol check (runs inside .venv-msa) ----------------------------------------

def protocol_check(task: dict[str, Any]) -> dict[str, Any]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.exceptions import Submitted
    from minisweagent.models.test_models import DeterministicModel, make_output

    from flywheel.envs.sandbox import Limits, SandboxSpec, make_backend
    from flywheel.envs.swe.mini_swe_agent import (
        MiniSweAgentEnvironment,
        submitted_class,
    )

    spec = SandboxSpec(workdir=Path(task["workdir"]), readonly=tuple(Path(p) for p in task["readonly"]), env=task["env"],
                       limits=Limits(timeout_s=30))
    sandbox = make_backend("bubblewrap").open(spec, SLOT)
    try:
        env = MiniSweAgentEnvironment(sandbox)
        commands = [
            "pwd && id -u && git -c safe.directory='*' status --short | head -5",
            "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\" 2>&1 | tail -1",
            "cd / && export FOO=1 && pwd",
            "pwd && echo FOO=${FOO:-unset}",
            "echo '# touched by the protocol check' >> README.protocol && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
            " && git -c safe.directory='*' add -A && git -c safe.directory='*' diff --cached --stat",
        ]
        model = DeterministicModel(outputs=[make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(commands)])
        agent = DefaultAgent(model, env, system_template="scripted", instance_template="{{task}} on {{system}} {{machine}}",
                             cost_limit=0, step_limit=len(commands) + 1)
        result = agent.run("protocol check")
        observations = [m["content"] for m in agent.messages if m.get("role") == "user"][1:]
        return {"exit_status": result.get("exit_status"), "submission": result.get("submission"),
                "submitted_is_minisweagents": submitted_class() is Submitted, "commands": commands,
                "observations": observations, "serialize": env.serialize()}
    finally:
        sandbox.close()  # kills leftovers of the slot's uid and removes the workdir


async def protocol_run(work: Path, timeout_s: float) -> dict[str, Any]:
    from flywheel.envs.sandbox.bubblewrap import default_uid_base

    task, _ = prepare_task(work / "protocol")
    (work / "protocol-task.json").write_text(json.dumps(task))
    proc = await asyncio.create_subprocess_exec(
        str(MSA_VENV / "bin" / "python"), str(Path(__file__).resolve()),
        "--protocol-check", str(work / "protocol-task.json"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=msa_env(work), cwd=str(work))
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    text = out.decode(errors="replace")
    try:
        result = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": text[-3000:]}
    obs = result["observations"]
    checks = {
        "submitted": result["exit_status"] == "Submitted",
        "raises_minisweagents_Submitted": result["submitted_is_minisweagents"],
        "runs_in_repository_as_slot_uid": f"{task['workdir']}\n{default_uid_base() + SLOT}" in obs[0],
        "no_network": "Network is unreachable" in obs[1],
        "stateless_commands": task["workdir"] in obs[3] and "FOO=unset" in obs[3],
        "submission_is_the_diff": "README.protocol" in (result["submission"] or ""),
    }
    return {"checks": checks, "ok": all(checks.values()), **result}


# ---- main -----------------------------------------------------------------------------------

async def main_async(args: argparse.Namespace) -> int:
    from bench._common import machine, quiet_logs, write_result
    from flywheel.envs.sandbox.workdirs import work_root

    quiet_logs()
    if why := msa_available():
        print(f"mini-swe-agent is not installed: {why}", file=sys.stderr)
        return 2
    work = work_root() / f"bench-msa-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    try:
        endpoint = await endpoint_run(args, work)
        protocol = await protocol_run(work, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    msa_version = subprocess.run([str(MSA_VENV / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                                 capture_output=True, text=True).stdout
    versions = {p["name"]: p["version"] for p in json.loads(msa_version or "[]")
                if p["name"].lower() in ("mini-swe-agent", "litellm", "openai")}
    result = {"ok": endpoint["ok"] and protocol["ok"], "model": args.model, "client_versions": versions,
              "steps": args.steps, "config": args.config,
              "max_tokens": args.max_tokens, "endpoint": endpoint, "protocol": protocol, "machine": machine(None)}
    name = ("mini_swe_agent" + ("" if args.model == "tiny" else f"_{Path(args.model).name}")
            + ("" if args.config == "tool" else f"_{args.config}"))
    path = write_result(name, result)
    print(f"client: {versions}")
    print(f"task: {endpoint['task']['instance_id']} ({endpoint['task']['source']})")
    mini = endpoint["mini"]
    print(f"mini: rc {endpoint['mini_returncode']}, {mini['api_calls']} model calls, exit {mini['exit_status']}, "
          f"{mini['commands_executed']} commands run, {endpoint['mini_wall_s']} s")
    print(f"bus: {endpoint['turns_on_bus']} turns, {endpoint['trajectories_on_bus']} trajectories; "
          f"sessions {endpoint['sessions_seen']}")
    if "trajectory" in endpoint:
        t = endpoint["trajectory"]
        print(f"trajectory {t['id']}: {t['turns']} turns, {t['segments']} segments, {t['sampled_tokens']} sampled "
              f"of {t['tokens']} tokens, closed by {t['close_reason']}, reward {t['reward']}")
    for name, checks in (("endpoint", endpoint["checks"]), ("protocol", protocol.get("checks", {}))):
        for check, ok in checks.items():
            print(f"  {'PASS' if ok else 'FAIL'} {name}: {check}")
    if "error" in protocol:
        print(protocol["error"])
    print(f"{'OK' if result['ok'] else 'FAILED'}; wrote {path}")
    return 0 if result["ok"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/mini_swe_agent.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="the served model (tiny, smollm2-135m, a local HF folder)")
    parser.add_argument("--steps", type=int, default=3, help="mini-swe-agent's step limit (model calls)")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each model call")
    parser.add_argument("--timeout", type=float, default=300, help="limit for each client run, seconds")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tool",
                        help="mini-swe-agent's stock configuration: tool calls (mini.yaml) or text (mini_textbased.yaml)")
    parser.add_argument("--no-grade", dest="grade", action="store_false", help="reward 0 instead of grading the repository")
    parser.add_argument("--protocol-check", metavar="TASK_JSON", help=argparse.SUPPRESS)  # inside .venv-msa
    args = parser.parse_args()
    if args.protocol_check:
        print(json.dumps(protocol_check(json.loads(Path(args.protocol_check).read_text())), default=str))
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
