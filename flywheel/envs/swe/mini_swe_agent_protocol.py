"""The protocol check of the mini-swe-agent adapter (`mini_swe_agent.MiniSweAgentEnvironment`):
mini-swe-agent's own `DefaultAgent` with its `DeterministicModel` drives a bubblewrap sandbox over
the check's task through the adapter. Commands must run as the slot's uid in the repository,
without network, statelessly, and the submit marker must raise mini-swe-agent's own `Submitted`
with the diff as the submission.

`protocol_run` runs `protocol_check` inside mini-swe-agent's virtualenv, as

    python -m flywheel.envs.swe.mini_swe_agent_protocol TASK_JSON

and checks what it printed. Nothing here imports mini-swe-agent at import time.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from flywheel.envs.swe.mini_swe_agent_task import SLOT, prepare_task
from flywheel.envs.swe.mini_swe_agent_venv import MSA_VENV, msa_env


def protocol_check(task: dict[str, Any]) -> dict[str, Any]:
    """Inside mini-swe-agent's virtualenv: its `DefaultAgent` runs scripted commands in a sandbox
    over `task` (`prepare_task`'s) through the adapter; what it saw and submitted."""
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
    """`protocol_check` in mini-swe-agent's virtualenv on a task prepared under `work`, and the
    checks of what it returned (`checks`, `ok`)."""
    from flywheel.envs.sandbox.bubblewrap import default_uid_base

    task, _ = prepare_task(work / "protocol")
    (work / "protocol-task.json").write_text(json.dumps(task))
    proc = await asyncio.create_subprocess_exec(
        str(MSA_VENV / "bin" / "python"), "-m", "flywheel.envs.swe.mini_swe_agent_protocol", str(work / "protocol-task.json"),
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


if __name__ == "__main__":
    print(json.dumps(protocol_check(json.loads(Path(sys.argv[1]).read_text())), default=str))
