"""Operators' view of the versions, against a running promotion loop, gateway and evaluation
server: `flywheel versions` (list, show, rollback, promote, a refusal, no promotion
loop), the gateway's admin API (its key, its results), `/dashboard.json`, the `/dashboard` page
and the per-version Prometheus series."""

import asyncio
import subprocess
from pathlib import Path

import httpx

from flywheel.bus import WEIGHTS_SUBJECT, WeightUpdate
from flywheel.bus.addresses import BUS, write_address
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.models import WeightStore, load_model
from flywheel.promote.loop import PromoteLoop
from flywheel.serve.loop import ServeLoop
from flywheel.versions.registry import Registry
from tests.test_promotion import _is
from tests.waiting import until

ROOT = Path(__file__).resolve().parent.parent
SUITE = "promotion.gate.suites=[{name: digits, env: digits, items: 4, max_new_tokens: 8}]"


async def versions_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process (the promotion loop runs on this test's event loop meanwhile)."""
    return await asyncio.to_thread(subprocess.run, [*command("versions", f"run_dir={run_dir}"), *args],
                                   cwd=ROOT, capture_output=True, text=True, timeout=120)


async def test_cli_admin_api_dashboard_and_metrics(bus, nats_url, tmp_path):
    write_address(tmp_path, BUS, nats_url)
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "promotion.mode=gate", SUITE,
                                "promotion.gate.guards.probe_prompts=2", "serve.admin_key=adm"])
    evaluator = ServeLoop(side_server_config(config, "eval"), nats_url)
    await evaluator.start()
    config.promotion.eval_url = evaluator.url
    serve = ServeLoop(config, nats_url)
    await serve.start()
    promoter = PromoteLoop(config, nats_url)
    await promoter.start()
    registry = await Registry.open(bus)
    http = httpx.AsyncClient(base_url=serve.url, timeout=120)
    admin = {"Authorization": "Bearer adm"}
    try:
        path = str(WeightStore(tmp_path / "weights").publish(load_model("tiny")[0], 1))
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w1", version=1, path=path, step=1, parent=0))
        await until(lambda: _is(registry, 1, "serving"))

        listed = await versions_cli(tmp_path, "list")
        assert listed.returncode == 0, listed.stderr
        assert "v1" in listed.stdout and "serves everyone" in listed.stdout and "retired" in listed.stdout
        shown = await versions_cli(tmp_path, "show", "v1")
        assert shown.returncode == 0 and "gate: passed" in shown.stdout and "evaluating" in shown.stdout
        rolled = await versions_cli(tmp_path, "rollback", "--reason", "drill")
        assert rolled.returncode == 0 and "v1 rolled back; v0 serves" in rolled.stdout
        refused = await versions_cli(tmp_path, "promote", "7")
        assert refused.returncode == 1 and "no version 7" in refused.stdout
        assert (await versions_cli(tmp_path, "promote")).returncode == 2  # argparse: a version is needed

        assert (await http.get("/admin/versions")).status_code == 401
        listing = (await http.get("/admin/versions", headers=admin)).json()
        assert listing["routing"]["serving"]["version"] == 0 and [v["state"] for v in listing["versions"]] == ["serving", "rolled_back"]
        promoted = await http.post("/admin/versions/1/promote", headers=admin)
        assert promoted.status_code == 200 and promoted.json()["message"] == "v1 serves"
        missing = await http.post("/admin/versions/9/pin", headers=admin)
        assert missing.status_code == 409 and "no version 9" in missing.json()["error"]["message"]
        await until(lambda: _serving(serve, 1))

        board = (await http.get("/dashboard.json")).json()
        one = next(v for v in board["versions"] if v["version"] == 1)
        assert one["state"] == "serving" and [t["by"] for t in one["transitions"]][-2:] == ["operator", "operator"]
        assert "Flywheel policy versions" in (await http.get("/dashboard")).text
        metrics = (await http.get("/metrics")).text
        assert 'flywheel_version_state{state="serving",version="1"} 1.0' in metrics
        assert 'flywheel_version_state{state="retired",version="0"} 1.0' in metrics

        await promoter.stop()
        gone = await versions_cli(tmp_path, "unpin", "--timeout-s", "2")
        assert gone.returncode == 2 and "no promotion loop" in gone.stdout
    finally:
        await http.aclose()
        await promoter.stop()
        await serve.stop()
        await evaluator.stop()


async def _serving(serve: ServeLoop, version: int) -> bool:
    return serve.pool.weight_version == version
