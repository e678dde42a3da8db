"""The promotion drill: no version serves before it earns it, under live traffic and a kill -9.

The platform runs as processes of its own (`flywheel.drills.cluster.Cluster`): nats-server, the gateway,
collect, judge, the promotion loop and its evaluation server (`serve.role: eval`), with
`promotion.mode: canary`. Simulated users hold two-turn sessions through the official `openai`
client (each a `digits` task: the user asks, then asks again; the environment grades both replies
and the user sends the mean as feedback), `--concurrency` at a time, all drill long. Serving
starts on the untrained `tiny` (digits reward ≈ 0). The trainer's versions are real: first a
short `flywheel train` on digits (`configs/local.yaml`, promotion off, `--train-steps` steps)
keeps every version it published; then a stand-in trainer publishes, in the order the issue
asks, a good version (that run's version `--good-steps`), a harmful one (the same weights with
Gaussian noise of `--noise` on every weight: its replies stop being digits), and a good one
again (the run's last version), each descending from the version the registry says to continue
from. The gate is loosened (margin 2, guards off) so that the harmful version reaches the
canary: what is drilled is the canary's rollback (tests/test_promotion.py shows the default gate
rejecting noised weights). Mid-canary of the harmful version, the promotion loop is killed with
SIGKILL and started again.

Measured: each version's fate and the sessions its canary took to decide, the share of new
sessions the harmful version served while it was canary (bound: `--share`), requests that
failed (must be 0), sessions whose trajectory is not one exact segment (must be 0; those whose
version changed under them, because theirs stopped being served, are counted apart), whether the registry (states, the canary's evidence) survived the kill unchanged, and a
screenshot of `/dashboard` in headless Chromium (Debian's `chromium`).

    .venv/bin/python -m bench.promotion_drill            # writes bench/results/promotion_drill.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS, ROOT, write_result  # noqa: E402
from bench.lib.train_runs import train_run  # noqa: E402
from flywheel.bus import WEIGHTS_SUBJECT, Bus, Trajectory, WeightUpdate  # noqa: E402
from flywheel.bus.cluster import free_port  # noqa: E402
from flywheel.cli import command  # noqa: E402
from flywheel.drills.audit import read_stream  # noqa: E402
from flywheel.drills.cluster import Cluster  # noqa: E402
from flywheel.drills.noised_weights import publish_noised  # noqa: E402
from flywheel.envs import make_env  # noqa: E402
from flywheel.models import WeightStore  # noqa: E402
from flywheel.versions.registry import Registry  # noqa: E402

SCREENSHOT = RESULTS / "promotion_drill_dashboard.png"


class Users:
    """Simulated users: two-turn digits sessions, graded, with the grade as feedback."""

    def __init__(self, url: str, concurrency: int):
        self.url, self.concurrency = url, concurrency
        self.env = make_env("digits", {})
        self.sessions: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}
        self.requests = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        http = httpx.AsyncClient(base_url=self.url, timeout=120)
        client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="drill", max_retries=0, http_client=http)
        counter = iter(range(10**9))

        async def session(i: int) -> None:
            sid, rng = f"user{i}", random.Random(i)
            task = self.env.reset(rng)
            record = self.sessions[sid] = {"started": time.time(), "versions": [], "reward": None, "first_at": None}
            messages: list[dict[str, Any]] = list(task.messages)
            grades = []
            try:
                for follow_up in ("Again, digits only please.", None):
                    self.requests += 1
                    reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                                 extra_headers={"X-Session-Id": sid})
                    text = reply.choices[0].message.content or ""
                    record["first_at"] = record["first_at"] or time.time()
                    record["versions"].append(int(reply.system_fingerprint.removeprefix("flywheel-v")))
                    grades.append(self.env.verify(task, text))
                    messages += [{"role": "assistant", "content": text}, *([{"role": "user", "content": follow_up}] if follow_up else [])]
                record["reward"] = sum(grades) / len(grades)
                self.requests += 1
                (await http.post(f"/v1/sessions/{sid}/feedback", json={"reward": record["reward"], "source": "env"})).raise_for_status()
            except Exception as exc:
                self.failed[sid] = f"{type(exc).__name__}: {exc}"

        async def worker() -> None:
            while not self.stop.is_set():
                await session(next(counter))

        try:
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        finally:
            await client.close()


async def until(check, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)
    return found


async def decided(registry: Registry, version: int) -> Any:
    entry = await registry.get(version)
    return entry if entry is not None and entry.state in ("serving", "rolled_back", "rejected") else None


def screenshot(url: str, out: Path) -> str | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        return "chromium is not installed (apt-get install chromium)"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,900",
                           "--virtual-time-budget=4000", f"--screenshot={out}", f"{url}/dashboard"],
                          capture_output=True, text=True, timeout=120)
    return None if done.returncode == 0 and out.exists() else done.stderr[-500:]


def pretrain(run_dir: Path, steps: int) -> dict[int, str]:
    """A short `flywheel train` on digits (kept in `run_dir`: a second drill reuses it); every version
    it published, by version."""
    if not (run_dir / "weights" / f"v{steps}").exists():
        run = train_run("pretrain", "configs/local.yaml", run_dir,
                        [f"train.max_steps={steps}", "promotion.mode=off", f"train.keep_versions={steps + 1}", "serve.port=0"])
        print(f"trained {steps} steps on digits: reward {run.metrics[0]['reward_mean']:.3f} -> {run.final_reward(3):.3f}")
    return {v: str(run_dir / "weights" / f"v{v}") for v in range(1, steps + 1)}


async def drill(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    trained = await asyncio.to_thread(pretrain, args.pretrain_dir or run_dir / "pretrain", args.train_steps)
    eval_port = free_port()
    overrides = ["model=tiny", "rollout.enabled=false", "promotion.mode=canary", f"promotion.eval_url=http://127.0.0.1:{eval_port}",
                 "promotion.gate.suites=[{name: digits, env: digits, items: 16, max_new_tokens: 8, margin: 2.0}]",
                 "promotion.gate.guards.max_kl=1000",
                 "promotion.gate.guards.max_length_ratio=1000", "promotion.gate.guards.max_malformed_tool_calls=1",
                 "promotion.gate.guards.max_empty_or_cut=1", f"promotion.canary.share={args.share}",
                 f"promotion.canary.delta={args.delta}", "promotion.canary.beta=0.05", "promotion.canary.min_sessions=10",
                 "judge.teacher.enabled=false", "serve.torch_threads=1"]
    cluster = Cluster(run_dir, overrides)
    cluster.start_nats()
    log = (run_dir / "eval.log").open("a")
    evaluator = subprocess.Popen([*command("serve"), f"bus.url={cluster.bus_url}", f"run_dir={run_dir}", *overrides,
                                  "serve.role=eval", f"serve.port={eval_port}", f"serve.spill_dir={run_dir / 'spill' / 'eval'}"],
                                 cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    for kind in ("serve", "collect", "judge", "promote"):
        cluster.start(kind)
    bus = None
    try:
        await cluster.wait_serving(urls=[cluster.serve_urls[0], f"http://127.0.0.1:{eval_port}"])
        bus = await Bus.connect(cluster.bus_url, name="drill")
        registry = await Registry.open(bus)
        store = WeightStore(run_dir / "weights", keep=10)
        users = Users(cluster.serve_urls[0], args.concurrency)
        load = asyncio.create_task(users.run())
        report: dict[str, Any] = {"versions": {}, "kill": {}}
        await until(lambda: _online_at_least(registry, 0, 20), 300, "20 judged sessions on v0")

        async def publish(version: int, source: str, noise: float, label: str) -> Any:
            directive = await registry.directive()
            parent = directive.version if directive is not None else (await registry.routing()).serving.version
            path = await asyncio.to_thread(publish_noised, store, version, noise, source)
            started = time.time()
            await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id=f"w{version}", version=version, path=path, step=version, parent=parent))
            if label == "harmful":
                report["kill"] = await kill_mid_canary(cluster, registry, version, args.kill_after)
            entry = await until(lambda: decided(registry, version), args.timeout_s, f"a decision on v{version}")
            report["versions"][f"v{version}"] = {"label": label, "parent": parent, "state": entry.state,
                                                 "decided_by": entry.transitions[-1].by, "reason": entry.transitions[-1].reason,
                                                 "canary": entry.canary, "seconds": time.time() - started}
            return entry

        await publish(1, trained[args.good_steps], 0.0, "good")
        await publish(2, trained[args.good_steps], args.noise, "harmful")
        await publish(3, trained[args.train_steps], 0.0, "good")
        users.stop.set()
        await load
        report["shot_error"] = screenshot(cluster.serve_urls[0], SCREENSHOT)
        report.update(await audit(bus, registry, users))
        return report
    finally:
        if bus is not None:
            await bus.close()
        evaluator.terminate()
        evaluator.wait(timeout=60)
        cluster.stop()


async def _online_at_least(registry: Registry, version: int, n: int) -> bool:
    entry = await registry.get(version)
    return entry is not None and entry.online_reward()[0] >= n


async def kill_mid_canary(cluster: Cluster, registry: Registry, version: int, after: int) -> dict[str, Any]:
    """SIGKILL the promotion loop once the canary has `after` judged sessions; start it again."""
    async def evidence():
        entry = await registry.get(version)
        return entry if entry is not None and entry.state == "canary" and entry.canary["canary_arm"]["n"] >= after else None

    before = await until(evidence, 600, f"{after} canary sessions on v{version}")
    cluster.kill("promote")
    killed = await registry.get(version)
    cluster.restart("promote")
    return {"canary_sessions_at_kill": killed.canary["canary_arm"]["n"], "state_at_kill": killed.state,
            "registry_kept": killed.state == "canary" and killed.canary["canary_arm"]["n"] >= before.canary["canary_arm"]["n"]}


async def audit(bus: Bus, registry: Registry, users: Users) -> dict[str, Any]:
    entries = {e.version: e for e in await registry.versions()}
    harmful = entries[2]
    canary_from = next(t.at for t in harmful.transitions if t.state == "canary")
    canary_to = harmful.transitions[-1].at
    during = [s for s in users.sessions.values() if canary_from <= s["started"] < canary_to and s["versions"]]
    on_harmful = [s for s in during if s["versions"][0] == 2]
    trajectories = [t for t in await read_stream(bus, "TRAJECTORIES", Trajectory) if t.session_id in users.sessions]
    not_one_segment = [t.session_id for t in trajectories if len(t.segments) != 1]
    crossed = [t.session_id for t in trajectories if len({v for seg in t.segments for v, m in zip(seg.versions, seg.loss_mask) if m}) > 1]
    by_version: dict[int, list[float]] = defaultdict(list)
    for s in users.sessions.values():
        if s["reward"] is not None and len(set(s["versions"])) == 1:
            by_version[s["versions"][0]].append(s["reward"])
    return {
        "sessions": len(users.sessions), "requests": users.requests, "failed_requests": len(users.failed),
        "failures": dict(list(users.failed.items())[:5]),
        "harmful_canary": {"sessions_started": len(during), "served_by_it": len(on_harmful),
                           "share": len(on_harmful) / len(during) if during else None,
                           "judged_canary_sessions_at_rollback": harmful.canary["canary_arm"]["n"]},
        "trajectories": len(trajectories), "not_one_exact_segment": len(not_one_segment),
        "not_one_exact_segment_examples": not_one_segment[:5],
        "crossed_a_version": len(crossed),
        "session_log": [[round(s["started"], 3), *s["versions"]] for s in users.sessions.values()],
        "mean_reward_by_version": {f"v{v}": sum(r) / len(r) for v, r in sorted(by_version.items())},
        "final_routing": (await registry.routing()).serving.version,
        "directive": (await registry.directive()).version if await registry.directive() else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.promotion_drill", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--train-steps", type=int, default=36, help="steps of the flywheel train that makes the good versions")
    parser.add_argument("--good-steps", type=int, default=28, help="its version that is the first good one")
    parser.add_argument("--pretrain-dir", type=Path, help="keep that flywheel train here (and reuse it when it is there)")
    parser.add_argument("--kill-after", type=int, default=5, help="judged canary sessions before the promoter is killed")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flywheel-promotion-") as tmp:
        report = asyncio.run(drill(Path(tmp), args))
    report["settings"] = vars(args)
    path = write_result("promotion_drill", report)
    for name, v in report["versions"].items():
        print(f"{name} ({v['label']}): {v['state']} by {v['decided_by']} after {v['seconds']:.0f} s: {v['reason']}")
    h = report["harmful_canary"]
    print(f"harmful canary: served {h['served_by_it']}/{h['sessions_started']} new sessions (share {args.share}); "
          f"rolled back after {h['judged_canary_sessions_at_rollback']} judged canary sessions; kill -9 mid-canary: {report['kill']}")
    print(f"{report['sessions']} sessions, {report['failed_requests']} failed; {report['not_one_exact_segment']} trajectories not "
          f"one exact segment; rewards {report['mean_reward_by_version']}; screenshot: {report['shot_error'] or SCREENSHOT}")
    print(f"wrote {path}")
    ok = (report["failed_requests"] == 0 and report["not_one_exact_segment"] == 0 and report["kill"].get("registry_kept")
          and report["versions"]["v2"]["state"] == "rolled_back")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
