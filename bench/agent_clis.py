"""Agent CLIs, unmodified, against the Flywheel endpoint: Codex CLI (`codex exec`, Responses API)
and Claude Code (`claude -p`, Anthropic Messages) run headless on a small task; and a recorded
Claude Code run that starts a sub-agent, replayed. Checked: what the gateway recorded, and how
the collect loop arranged each session: trajectories, threads (conversations), segments.

Live runs (--codex, --claude)
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
    trajectories are read from the bus. `tiny` (random weights) writes text until its token cap,
    so both CLIs see every answer cut at max tokens (protocol, recording and stitching are what
    is checked, not answers).

A sub-agent, recorded (--record-subagent CLAUDE) and replayed (--replay)
    No model served here makes Claude Code start a sub-agent, so the request sequence of such a
    run is recorded from the real CLI driven by a scripted model (`bench/lib/scripted_anthropic.py`:
    the main agent calls the sub-agent tool, the sub-agent runs `ls` and answers, the title call
    gets a title) with `claude -p "Use a sub-agent to list the files here." --allowedTools
    Bash,Agent --model MODEL` (nonessential traffic on, so the title call is in it) and saved
    to bench/data/claude_code_subagent.json (Claude Code 2.1.197; other versions' recordings as
    claude_code_subagent_<version>.json, with --fixture): every request's body, the headers that
    matter and the scripted answer. `--replay` sends each through the platform (`bench/lib/claude_replay.py`),
    once with the served model sampling freely (`free`) and once with each answer steered to the
    scripted one (`steered`), and reports each request's thread next to the conversation it
    belongs to.

Every CLI runs with HTTPS_PROXY / HTTP_PROXY set to a local proxy that refuses every connection
(and NO_PROXY for 127.0.0.1), so it can reach nothing but the local servers; the hosts it tried
are reported (`blocked`).

Reported per run: exit status, the end of the CLI's output, each recorded turn (API, session,
prompt and output tokens, finish reason, tool calls), each trajectory (turns, threads and which
turns are in each, segments per thread, sampled tokens, retry orphans, unused turns, masked
tokens) and the collect loop's counts.

How to run (from the repository root; the CLIs from npm)
    npm install --prefix /tmp/agent-clis @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.197
    .venv/bin/python -m bench.agent_clis --codex /tmp/agent-clis/node_modules/.bin/codex \\
        --claude /tmp/agent-clis/node_modules/.bin/claude [--model tiny]
    .venv/bin/python -m bench.agent_clis --record-subagent /tmp/agent-clis/node_modules/.bin/claude
    .venv/bin/python -m bench.agent_clis --replay free,steered
    Writes bench/results/agent_clis_<model>.json (live), agent_clis_replay_<model>.json (replay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import git_commit, quiet_logs, write_result  # noqa: E402

PROMPT = "list the files here"
SUBAGENT_TASK = "Use a sub-agent to list the files here."


def codex_command(executable: str, served_url: str, model: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / "config.toml").write_text(
        'model_provider = "flywheel"\n[model_providers.flywheel]\nname = "flywheel"\n'
        f'base_url = "{served_url}/v1"\nwire_api = "responses"\nenv_key = "FLYWHEEL_KEY"\n')
    command = [executable, "exec", "--skip-git-repo-check", "-m", model, "-s", "danger-full-access", PROMPT]
    return command, {"CODEX_HOME": str(home), "FLYWHEEL_KEY": "unused"}


def claude_command(executable: str, served_url: str, model: str, home: Path, prompt: str = PROMPT, tools: str = "Bash",
                   nonessential: bool = False) -> tuple[list[str], dict[str, str]]:
    """`claude -p`; `nonessential` lets it make its helper calls (the session title)."""
    command = [executable, "-p", prompt, "--output-format", "json", "--allowedTools", tools, "--model", model]
    env = {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_BASE_URL": served_url,
           "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    if not nonessential:
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    return command, env


COMMANDS = {"codex": codex_command, "claude": claude_command}


class OutboundBlock:
    """A local HTTP proxy that refuses every request and remembers what was asked for: set as a
    CLI's proxy, it keeps the CLI from reaching anything but the local servers (NO_PROXY)."""

    def __init__(self) -> None:
        self.blocked: list[str] = []

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        self.blocked.append(" ".join(line.decode(errors="replace").split()[:2]))
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> "OutboundBlock":
        self._server = await asyncio.start_server(self._refuse, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self.env = {key: url for key in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")}
        self.env |= {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._server.close()
        await self._server.wait_closed()


async def run_process(command: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run a CLI in a scratch directory holding a.txt and b.txt, behind an `OutboundBlock`."""
    work = Path(tempfile.mkdtemp())
    (work / "a.txt").write_text("a")
    (work / "b.txt").write_text("b")
    started = time.monotonic()
    async with OutboundBlock() as block:
        process = await asyncio.create_subprocess_exec(*command, cwd=work, env={**os.environ, **block.env, **env},
                                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            process.kill()
            out, err = await process.communicate()
    return {"exit": process.returncode, "seconds": round(time.monotonic() - started, 1), "blocked": block.blocked,
            "stdout": out.decode()[-3000:], "stderr": err.decode()[-3000:]}


# ---- the platform, and what it made of a run ------------------------------------------------

@dataclass
class Platform:
    """The gateway with its embedded engine (`served`: a `bench.lib.served.Served`), the collect loop,
    and this bench's consumers of the traffic and trajectory streams."""

    served: Any
    collect: Any
    consumers: tuple[Any, Any]

    @property
    def url(self) -> str:
        return self.served.url


@contextlib.asynccontextmanager
async def flywheel(model: str, overrides: list[str]) -> AsyncIterator[Platform]:
    """Serve `model` with the collect loop, on a private bus."""
    from bench.lib.served import Served
    from flywheel.bus import TRAFFIC_SUBJECTS, TRAJECTORY_SUBJECT, Bus
    from flywheel.collect.loop import CollectLoop

    async with Served(model, [*overrides, "collect.feedback_grace_s=0"]) as served:
        collect = CollectLoop(served.config, served.nats_url)
        await collect.start()
        bus = await Bus.connect(served.nats_url, name="agent-clis")
        consumers = (bus.consumer(TRAFFIC_SUBJECTS, "agent-clis-traffic"), bus.consumer(TRAJECTORY_SUBJECT, "agent-clis-trajectories"))
        try:
            yield Platform(served, collect, consumers)
        finally:
            await bus.close()
            await collect.stop()


async def drain(consumer) -> list:
    """Everything the consumer holds now (acknowledged)."""
    deliveries = []
    while batch := await consumer.fetch(timeout_s=0.5):
        for delivery in batch:
            await delivery.ack()
        deliveries += batch
    return deliveries


async def collected(platform: Platform, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """End every session recorded since the last call and read back its trajectories; returns
    the turns, the trajectories (`labels`: names for turn ids) and the collect loop's counts."""
    from flywheel.bus import Trajectory, Turn

    traffic, trajectories = platform.consumers
    turns = [d.record for d in await drain(traffic) if isinstance(d.record, Turn)]
    sessions = sorted({t.session_id for t in turns})
    async with httpx.AsyncClient(base_url=platform.url) as http:
        for session in sessions:
            (await http.post(f"/v1/sessions/{session}/end")).raise_for_status()
    closed: list[Trajectory] = []
    deadline = time.monotonic() + 60
    while {t.session_id for t in closed} != set(sessions) and time.monotonic() < deadline:
        closed += [d.record for d in await drain(trajectories) if isinstance(d.record, Trajectory)]
    labels = labels or {}
    return {"turns": [turn_row(t, labels) for t in turns], "trajectories": [trajectory_row(t, labels) for t in closed],
            "collect": {k: v for k, v in platform.collect.stats().items() if v}}


def turn_row(turn, labels: dict[str, str]) -> dict[str, Any]:
    return {"turn": labels.get(turn.id, f"#{turn.turn_index}"), "endpoint": turn.endpoint, "session_id": turn.session_id,
            "prompt_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids), "finish_reason": turn.finish_reason,
            "tool_calls": [c["function"]["name"] for c in turn.response.get("tool_calls") or []]}


def trajectory_row(trajectory, labels: dict[str, str]) -> dict[str, Any]:
    """A trajectory's shape: its threads (the turns in each, by label) and each one's segments."""
    threads = trajectory.threads or [0] * len(trajectory.turns)
    members: dict[int, list[str]] = {}
    for thread, turn in zip(threads, trajectory.turns):
        members.setdefault(thread, []).append(labels.get(turn.id, f"#{turn.turn_index}"))
    segments: dict[int, int] = {}
    for segment in trajectory.segments:
        thread = threads[segment.turn_spans[0][0]] if segment.turn_spans else -1
        segments[thread] = segments.get(thread, 0) + 1
    return {"session_id": trajectory.session_id, "turns": len(trajectory.turns), "threads": len(members),
            "thread_turns": [members[k] for k in sorted(members)], "segments": len(trajectory.segments),
            "segments_per_thread": [segments.get(k, 0) for k in sorted(members)], "sampled_tokens": trajectory.num_sampled_tokens,
            "retry_orphans": trajectory.retry_orphans, "unused_turns": trajectory.unused_turns,
            "masked_tokens": trajectory.masked_tokens, "close_reason": trajectory.close_reason}


# ---- the modes -----------------------------------------------------------------------------

async def run_cli(name: str, executable: str, platform: Platform, timeout: float) -> dict[str, Any]:
    """Run one CLI against the platform to its end; its exit, output, turns and trajectories."""
    command, env = COMMANDS[name](executable, platform.url, platform.served.loop.model_name, Path(tempfile.mkdtemp()))
    return {**await run_process(command, env, timeout), **await collected(platform)}


async def record_subagent(executable: str, model: str, timeout: float) -> dict[str, Any]:
    """Run Claude Code against the scripted model on SUBAGENT_TASK; returns the fixture (raises
    if the run did not start a sub-agent)."""
    from bench.lib.scripted_anthropic import ScriptedAnthropic

    version = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    async with ScriptedAnthropic(SUBAGENT_TASK) as scripted:
        command, env = claude_command(executable, scripted.url, model, Path(tempfile.mkdtemp()), prompt=SUBAGENT_TASK,
                                      tools="Bash,Agent", nonessential=True)
        run = await run_process(command, env, timeout)
    roles = [r.get("role") for r in scripted.records if "body" in r]
    if run["exit"] != 0 or roles.count("subagent") < 2 or roles.count("main") < 2:
        raise RuntimeError(f"Claude Code did not go through a sub-agent: exit {run['exit']}, roles {roles}\n{run['stderr']}")
    return {"claude_code": version, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "prompt": SUBAGENT_TASK,
            "command": [Path(command[0]).name, *command[1:]], "env": sorted(env), **{k: run[k] for k in ("exit", "blocked")},
            "result": json.loads(run["stdout"]).get("result"), "requests": scripted.records}


async def replay_subagent(platform: Platform, fixture: dict[str, Any], mode: str) -> dict[str, Any]:
    """Replay a recorded run through the platform (`mode`: free or steered) and check its threads."""
    from bench.lib.claude_replay import Steered, message_requests, replay

    steered = None
    if mode == "steered":
        pool = platform.served.loop.pool
        pool.engines = [steered := Steered(engine) for engine in pool.engines]
    sent = await replay(platform.url, platform.served.loop.model_name, fixture, steered)
    labels = {r["interaction_id"]: f"r{r['index']} {r['role']}" for r in sent if r["interaction_id"]}
    out = {"claude_code": fixture["claude_code"], "requests": sent, **await collected(platform, labels)}
    out["check"] = thread_check(message_requests(fixture), sent, out)
    return out


def thread_check(recorded: list[dict[str, Any]], sent: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    """Whether each conversation of the recording (the main agent, the sub-agent, each helper
    call) is one thread of its own, and whether every request was recorded and every recorded
    turn is in the trajectory or counted as left out."""
    expected: dict[str, list[str]] = {}
    for r in recorded:
        key = r["role"] if r["role"] in ("main", "subagent") else f"helper {r['index']}"
        expected.setdefault(key, []).append(f"r{r['index']} {r['role']}")
    threads = [thread for t in out["trajectories"] for thread in t["thread_turns"]]
    in_trajectories = sum(t["turns"] for t in out["trajectories"])
    left_out = sum(t["retry_orphans"] + t["unused_turns"] for t in out["trajectories"])
    return {"requests_ok": sum(r["status"] == 200 for r in sent), "requests": len(sent), "turns_recorded": len(out["turns"]),
            "own_threads": sorted(expected.values()) == sorted(threads), "expected_threads": list(expected.values()),
            "lost": len(out["turns"]) - in_trajectories - left_out}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for cli in COMMANDS:
        parser.add_argument(f"--{cli}", metavar="EXECUTABLE", help=f"run {cli} (the executable npm installed)")
    parser.add_argument("--record-subagent", metavar="CLAUDE", help="record Claude Code's sub-agent run into the fixture")
    parser.add_argument("--replay", metavar="MODES", help="replay the recorded runs: free, steered or both (free,steered)")
    parser.add_argument("--fixture", type=Path, action="append",
                        help="the recording to write (--record-subagent) or replay (--replay; repeatable); "
                             "default: bench/data/claude_code_subagent.json, and for --replay every claude_code_subagent*.json there")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="serve.max_new_tokens (steered replays: at least 1024)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    quiet_logs()
    if args.record_subagent:
        await record(args.record_subagent, args.fixture[0] if args.fixture else None, args.model, args.timeout)
    if args.replay:
        await replays(args.fixture, args.replay.split(","), args.model, args.max_new_tokens)
    clis = {cli: getattr(args, cli) for cli in COMMANDS if getattr(args, cli)}
    if clis:
        await live(clis, args.model, args.max_new_tokens, args.timeout)


async def live(clis: dict[str, str], model: str, max_new_tokens: int, timeout: float) -> None:
    """Each CLI (name -> executable) run against a fresh platform."""
    results = {}
    for cli, executable in clis.items():
        async with flywheel(model, [f"serve.max_new_tokens={max_new_tokens}"]) as platform:
            results[cli] = summary = await run_cli(cli, executable, platform, timeout)
        show(f"{cli}: exit {summary['exit']} after {summary['seconds']} s; blocked {summary['blocked']}",
             summary, summary["stdout"][-800:] or summary["stderr"][-800:])
    out = write_result(f"agent_clis_{Path(model).name}", {"commit": git_commit(), "model": model, **results})
    print(f"wrote {out}")


async def record(executable: str, path: Path | None, model: str, timeout: float) -> None:
    """Record Claude Code's sub-agent run into `path` (default: the 2.1.197 fixture)."""
    from bench.lib.claude_replay import FIXTURE

    path = path or FIXTURE
    fixture = await record_subagent(executable, model, timeout)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB): Claude Code {fixture['claude_code']}, {len(fixture['requests'])} "
          f"requests: {[r.get('role') for r in fixture['requests']]}; blocked {fixture['blocked']}")


async def replays(paths: list[Path] | None, modes: list[str], model: str, max_new_tokens: int) -> None:
    """Each recording replayed in each mode, on a fresh platform each time."""
    from bench.lib.claude_replay import fixtures

    results = {}
    for path in paths or fixtures():
        fixture = json.loads(path.read_text())
        for mode in modes:
            tokens = max_new_tokens if mode == "free" else max(max_new_tokens, 1024)
            async with flywheel(model, [f"serve.max_new_tokens={tokens}"]) as platform:
                summary = await replay_subagent(platform, fixture, mode)
            results[f"{path.name} {mode}"] = summary
            show(f"replay of {path.name} (Claude Code {fixture['claude_code']}), {mode}", summary)
    out = write_result(f"agent_clis_replay_{Path(model).name}", {"commit": git_commit(), "model": model, **results})
    print(f"wrote {out}")


def show(title: str, summary: dict[str, Any], output: str = "") -> None:
    print(title)
    if output:
        print(output)
    for row in summary.get("requests", []) + summary["turns"] + summary["trajectories"]:
        print("  ", row)
    print("   collect:", summary["collect"])
    if "check" in summary:
        print("   check:", summary["check"])


if __name__ == "__main__":
    asyncio.run(main())
