"""Codex CLI, unmodified, against the Flywheel endpoint: what it sends, whether the stream it gets
back works for it, and what is recorded.

What it does
    Serves MODEL (the gateway with its embedded engine and an embedded NATS server), writes a
    throw-away `CODEX_HOME/config.toml` whose provider points at the gateway (`wire_api =
    "responses"`, the only one Codex 0.169 accepts), and runs

        codex exec --skip-git-repo-check -m MODEL -s danger-full-access \\
            --disable multi_agent --disable goals -c web_search="disabled" "list the files here"

    in a scratch directory holding two files (the flags keep the first request at ~26 K characters,
    which SmolLM2's 8,192-token context holds; `danger-full-access` because Codex's own sandbox
    helper cannot be set up from a temporary CODEX_HOME). Then reads the turns the gateway
    recorded. Reported: Codex's exit status and output, and per recorded turn the API, the
    session id (Codex's `session-id` header), prompt and output tokens, finish reason.

How to run (from the repository root; needs the CLI from npm)
    npm install --prefix /tmp/codex @openai/codex@0.169.0
    .venv/bin/python -m bench.codex_cli --codex /tmp/codex/node_modules/.bin/codex [--model smollm2-135m]
    Writes bench/results/codex_cli_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench._common import git_commit, quiet_logs, write_result

PROMPT = "list the files here"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codex", required=True, help="the codex executable")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    quiet_logs()
    from bench._serve import Served
    from bus import TRAFFIC_SUBJECTS, Bus, Turn

    overrides = [f"serve.max_new_tokens={args.max_new_tokens}", f"serve.default_max_new_tokens={args.max_new_tokens}"]
    async with Served(args.model, overrides) as served:
        home, work = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
        (work / "a.txt").write_text("a")
        (work / "b.txt").write_text("b")
        (home / "config.toml").write_text(
            'model_provider = "flywheel"\n[model_providers.flywheel]\nname = "flywheel"\n'
            f'base_url = "{served.url}/v1"\nwire_api = "responses"\nenv_key = "FLYWHEEL_KEY"\n')
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            args.codex, "exec", "--skip-git-repo-check", "-m", served.loop.model_name, "-s", "danger-full-access",
            "--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"', PROMPT,
            cwd=work, env={**os.environ, "CODEX_HOME": str(home), "FLYWHEEL_KEY": "unused"},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), args.timeout)
        except asyncio.TimeoutError:
            process.kill()
            out, err = await process.communicate()
        seconds = time.monotonic() - started
        bus = await Bus.connect(served.nats_url, name="codex-check")
        consumer = bus.consumer(TRAFFIC_SUBJECTS, "codex-check")
        records = []
        for _ in range(10):
            records += [d.record for d in await consumer.fetch(timeout_s=0.5)]
        await bus.close()
    turns = [{"endpoint": t.endpoint, "session_id": t.session_id, "prompt_tokens": len(t.prompt_ids),
              "output_tokens": len(t.output_ids), "finish_reason": t.finish_reason}
             for t in records if isinstance(t, Turn)]
    print(f"codex exit {process.returncode} after {seconds:.0f} s")
    print(err.decode()[-1500:])
    for turn in turns:
        print(turn)
    path = write_result(f"codex_cli_{args.model}", {
        "commit": git_commit(), "model": args.model, "exit": process.returncode, "seconds": seconds,
        "stdout": out.decode()[-4000:], "stderr": err.decode()[-4000:], "turns": turns})
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
