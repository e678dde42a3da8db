"""Evidence 4 (issue 13): mini-swe-agent, installed as a real client, works an SWE task through
the Flywheel endpoint in a Flywheel sandbox, and its session becomes one trajectory on the bus.

How (`flywheel/drills/mini_swe_agent.py`, `flywheel/envs/swe/mini_swe_agent_protocol.py`):

- The platform: a private nats-server, the serve loop (the real gateway and embedded engine on
  `--model`, default `tiny`) and the collect loop, in this process.
- The client: mini-swe-agent 2.4.6's own `mini` CLI from its own virtualenv (`make msa-venv`:
  `.venv-msa`; through litellm it pins `openai<3` and `huggingface-hub<2`, so it cannot share
  Flywheel's venv), unchanged: `mini.yaml` with its `LitellmModel` as `openai/<model>` (or,
  `--config text`, `mini_textbased.yaml` with its `LitellmTextbasedModel`),
  `api_base` at the gateway and `extra_headers` carrying `X-Session-Id` / `X-Task-Id`, and
  `--environment-class flywheel.envs.swe.mini_swe_agent.MiniSweAgentEnvironment`, which opens a
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
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import machine, quiet_logs, write_result  # noqa: E402
from flywheel.drills.mini_swe_agent import CONFIGS, endpoint_run  # noqa: E402
from flywheel.envs.sandbox.workdirs import work_root  # noqa: E402
from flywheel.envs.swe.mini_swe_agent_protocol import protocol_run  # noqa: E402
from flywheel.envs.swe.mini_swe_agent_venv import MSA_VENV, msa_available  # noqa: E402


async def main_async(args: argparse.Namespace) -> int:
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
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
