"""Agent CLIs, unmodified, against the Flywheel endpoint: Codex CLI (`codex exec`, Responses API)
and Claude Code (`claude -p`, Anthropic Messages) run headless on a small task; checked: what the
gateway recorded, and that each CLI session came out of the collect loop as one trajectory.

What it does
    Serves MODEL (the gateway and its embedded engine, the collect loop, an embedded NATS
    server), then runs each CLI in a scratch directory holding two files, with the prompt "list
    the files here" and a throw-away home pointing it at the gateway:

        codex exec --skip-git-repo-check -m MODEL -s danger-full-access "list the files here"
            (CODEX_HOME/config.toml: a provider with wire_api = "responses", the only one 0.169
            accepts; danger-full-access because Codex's own sandbox helper cannot be set up from
            a temporary CODEX_HOME)
        claude -p "list the files here" --output-format json --allowedTools Bash --model MODEL
            (ANTHROPIC_BASE_URL = the gateway; nonessential traffic, telemetry and updates off)

    Once a CLI exits, every session it opened is ended (`POST /v1/sessions/{id}/end`) and its
    trajectories are read from the bus. Reported per CLI: exit status, the end of its output, each
    recorded turn (API, session id, prompt and output tokens, finish reason, tool calls) and each
    trajectory (session, turns, segments, sampled tokens).

The model
    `tiny` (random weights) writes text until its token cap, so both CLIs see every answer cut at
    max tokens (protocol, recording and stitching are what is checked, not answers).

How to run (from the repository root; the CLIs from npm)
    npm install --prefix /tmp/agent-clis @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.197
    .venv/bin/python -m bench.agent_clis --codex /tmp/agent-clis/node_modules/.bin/codex \
        --claude /tmp/agent-clis/node_modules/.bin/claude [--model tiny]
    Writes bench/results/agent_clis_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import git_commit, quiet_logs, write_result

PROMPT = "list the files here"


def codex_command(executable: str, served_url: str, model: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / "config.toml").write_text(
        'model_provider = "flywheel"\n[model_providers.flywheel]\nname = "flywheel"\n'
        f'base_url = "{served_url}/v1"\nwire_api = "responses"\nenv_key = "FLYWHEEL_KEY"\n')
    command = [executable, "exec", "--skip-git-repo-check", "-m", model, "-s", "danger-full-access", PROMPT]
    return command, {"CODEX_HOME": str(home), "FLYWHEEL_KEY": "unused"}


def claude_command(executable: str, served_url: str, model: str, home: Path) -> tuple[list[str], dict[str, str]]:
    command = [executable, "-p", PROMPT, "--output-format", "json", "--allowedTools", "Bash", "--model", model]
    return command, {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_BASE_URL": served_url,
                     "ANTHROPIC_API_KEY": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                     "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}


COMMANDS = {"codex": codex_command, "claude": claude_command}


async def run_cli(name: str, executable: str, served, consumers, timeout: float) -> dict[str, Any]:
    """Run one CLI to its end; returns its exit, output, recorded turns and trajectories."""
    from bus import Trajectory, Turn

    home, work = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    (work / "a.txt").write_text("a")
    (work / "b.txt").write_text("b")
    command, env = COMMANDS[name](executable, served.url, served.loop.model_name, home)
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(*command, cwd=work, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        out, err = await process.communicate()
    seconds = time.monotonic() - started
    traffic, trajectories = consumers
    turns = [d.record for d in await drain(traffic) if isinstance(d.record, Turn)]
    sessions = sorted({t.session_id for t in turns})
    async with httpx.AsyncClient(base_url=served.url) as http:
        for session in sessions:
            (await http.post(f"/v1/sessions/{session}/end")).raise_for_status()
    closed: list[Trajectory] = []
    deadline = time.monotonic() + 60
    while {t.session_id for t in closed} != set(sessions) and time.monotonic() < deadline:
        closed += [d.record for d in await drain(trajectories) if isinstance(d.record, Trajectory)]
    return {
        "exit": process.returncode, "seconds": round(seconds, 1),
        "stdout": out.decode()[-3000:], "stderr": err.decode()[-3000:],
        "turns": [{"endpoint": t.endpoint, "session_id": t.session_id, "prompt_tokens": len(t.prompt_ids),
                   "output_tokens": len(t.output_ids), "finish_reason": t.finish_reason,
                   "tool_calls": [c["function"]["name"] for c in t.response.get("tool_calls") or []]} for t in turns],
        "trajectories": [{"session_id": t.session_id, "turns": len(t.turns), "segments": len(t.segments),
                          "sampled_tokens": t.num_sampled_tokens, "close_reason": t.close_reason}
                         for t in closed],
    }


async def drain(consumer) -> list:
    """Everything the consumer holds now (acknowledged)."""
    deliveries = []
    while batch := await consumer.fetch(timeout_s=0.5):
        for delivery in batch:
            await delivery.ack()
        deliveries += batch
    return deliveries


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for cli in COMMANDS:
        parser.add_argument(f"--{cli}", metavar="EXECUTABLE", help=f"run {cli} (the executable npm installed)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    quiet_logs()
    from bench._serve import Served
    from bus import TRAFFIC_SUBJECTS, TRAJECTORY_SUBJECT, Bus
    from collect.loop import CollectLoop

    results: dict[str, Any] = {}
    for cli in (cli for cli in COMMANDS if getattr(args, cli)):
        overrides = [f"serve.max_new_tokens={args.max_new_tokens}", "collect.feedback_grace_s=0"]
        async with Served(args.model, overrides) as served:
            collect = CollectLoop(served.config, served.nats_url)
            await collect.start()
            bus = await Bus.connect(served.nats_url, name="agent-clis")
            consumers = (bus.consumer(TRAFFIC_SUBJECTS, "agent-clis-traffic"),
                         bus.consumer(TRAJECTORY_SUBJECT, "agent-clis-trajectories"))
            try:
                results[cli] = summary = await run_cli(cli, getattr(args, cli), served, consumers, args.timeout)
            finally:
                await bus.close()
                await collect.stop()
        print(f"{cli}: exit {summary['exit']} after {summary['seconds']} s")
        print(summary["stdout"][-800:] or summary["stderr"][-800:])
        for row in summary["turns"] + summary["trajectories"]:
            print("  ", row)
    path = write_result(f"agent_clis_{Path(args.model).name}", {"commit": git_commit(), "model": args.model, **results})
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
