"""Operators' view of the versions, against a running promotion loop, gateway and evaluation
server: `flywheel versions` (list, show, rollback, promote, a refusal, no promotion
loop), the gateway's admin API (its key, its results), `/dashboard.json`, the `/dashboard` page
and the per-version Prometheus series."""

import asyncio
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx

from flywheel.bus import WEIGHTS_SUBJECT, WeightUpdate
from flywheel.bus.addresses import BUS, write_address
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.cli import command
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.models import WeightStore, load_model
from flywheel.models.adapter_names import user_adapter
from flywheel.promote.loop import PromoteLoop
from flywheel.serve.loop import ServeLoop
from flywheel.versions.registry import Registry

from bus_reading import read
from factories import is_in_state
from waiting import until

ROOT = Path(__file__).resolve().parent.parent
SUITE = "promotion.gate.suites=[{name: digits, env: digits, items: 4, max_new_tokens: 8}]"


async def versions_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process (the promotion loop runs on this test's event loop meanwhile)."""
    return await asyncio.to_thread(subprocess.run, [*command("versions", f"run_dir={run_dir}"), *args],
                                   cwd=ROOT, capture_output=True, text=True, timeout=120)


@asynccontextmanager
async def operated(bus, nats_url: str, tmp_path):
    """A gateway (admin key `adm`), an evaluation server and a promotion loop in gate mode, once
    v1 (the starting weights again) has passed the gate and serves: (gateway, loops, registry,
    an HTTP client on the gateway). `loops.promoter` may be stopped by the test."""
    write_address(tmp_path, BUS, nats_url)
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0", "promotion.mode=gate", SUITE,
                                "promotion.gate.guards.probe_prompts=2", "serve.admin_key=adm"])
    evaluator = ServeLoop(side_server_config(config, "eval"), nats_url)
    await evaluator.start()
    config.promotion.eval_url = evaluator.url
    serve = ServeLoop(config, nats_url)
    await serve.start()
    loops = SimpleNamespace(promoter=PromoteLoop(config, nats_url))
    await loops.promoter.start()
    registry = await Registry.open(bus)
    http = httpx.AsyncClient(base_url=serve.url, timeout=120)
    try:
        path = str(WeightStore(tmp_path / "weights").publish(load_model("tiny")[0], 1))
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w1", version=1, path=path, step=1, parent=0))
        await until(lambda: is_in_state(registry, 1, "serving"))
        yield serve, loops, registry, http
    finally:
        await http.aclose()
        await loops.promoter.stop()
        await serve.stop()
        await evaluator.stop()


ADMIN = {"Authorization": "Bearer adm"}


async def test_flywheel_versions_lists_shows_and_commands_the_promotion_loop(bus, nats_url, tmp_path):
    async with operated(bus, nats_url, tmp_path):
        listed = await versions_cli(tmp_path, "list")
        assert listed.returncode == 0, listed.stderr
        assert "v1" in listed.stdout and "serves everyone" in listed.stdout and "retired" in listed.stdout
        shown = await versions_cli(tmp_path, "show", "v1")
        assert shown.returncode == 0 and "gate: passed" in shown.stdout and "evaluating" in shown.stdout
        rolled = await versions_cli(tmp_path, "rollback", "--reason", "drill")
        assert rolled.returncode == 0 and "v1 rolled back; v0 serves" in rolled.stdout
        refused = await versions_cli(tmp_path, "promote", "7")
        assert refused.returncode == 1 and "no version 7" in refused.stdout
        no_adapter = await versions_cli(tmp_path, "pin", "1", "--adapter", "acme")  # a line the registry lacks
        assert no_adapter.returncode == 1 and "no adapter acme in the registry" in no_adapter.stdout
        assert (await versions_cli(tmp_path, "promote")).returncode == 2  # argparse: a version is needed
        audited = await read(bus, AUDIT_SUBJECT, "audit-check", 3)
    # Every operator's command is on the audit log, with who, what and how it ended.
    assert [(e.actor, e.action, e.target, e.details["ok"]) for e in audited] == [
        ("cli", "version.rollback", "", True), ("cli", "version.promote", "v7", False),
        ("cli", "version.pin", "v1 of acme", False)]
    assert audited[0].details["reason"] == "drill"


async def test_flywheel_versions_says_so_when_no_promotion_loop_answers(bus, nats_url, tmp_path):
    async with operated(bus, nats_url, tmp_path) as (_, loops, _, _):
        await loops.promoter.stop()
        gone = await versions_cli(tmp_path, "unpin", "--timeout-s", "2")
        assert gone.returncode == 2 and "no promotion loop" in gone.stdout


async def test_the_admin_api_carries_out_commands_for_the_admin_key_only(bus, nats_url, tmp_path):
    async with operated(bus, nats_url, tmp_path) as (serve, _, _, http):
        assert (await http.get("/admin/versions")).status_code == 401
        listing = (await http.get("/admin/versions", headers=ADMIN)).json()
        assert listing["routing"]["serving"]["version"] == 1 and [v["state"] for v in listing["versions"]] == ["retired", "serving"]
        rolled = await http.post("/admin/versions/rollback", json={"reason": "drill"}, headers=ADMIN)
        assert rolled.status_code == 200 and rolled.json()["message"] == "v1 rolled back; v0 serves"
        promoted = await http.post("/admin/versions/1/promote", headers=ADMIN)
        assert promoted.status_code == 200 and promoted.json()["message"] == "v1 serves"
        missing = await http.post("/admin/versions/9/pin", headers=ADMIN)
        assert missing.status_code == 409 and "no version 9" in missing.json()["error"]["message"]
        no_adapter = await http.post("/admin/versions/rollback", json={"adapter": "acme"}, headers=ADMIN)
        assert no_adapter.status_code == 409 and "no adapter acme" in no_adapter.json()["error"]["message"]
        await until(lambda: _serving(serve, 1))
        one = next(v for v in (await http.get("/admin/versions", headers=ADMIN)).json()["versions"] if v["version"] == 1)
        assert [t["by"] for t in one["transitions"]][-2:] == ["operator", "operator"]


async def test_the_dashboard_and_the_metrics_show_each_versions_state(bus, nats_url, tmp_path):
    async with operated(bus, nats_url, tmp_path) as (serve, _, _, http):
        await until(lambda: _serving(serve, 1))
        assert (await http.get("/admin/versions", headers=ADMIN)).status_code == 200  # the board reads the registry now
        assert (await http.get("/dashboard.json")).status_code == 401  # it names every tenant's adapters
        board = (await http.get("/dashboard.json", headers=ADMIN)).json()
        one = next(v for v in board["versions"] if v["version"] == 1)
        assert one["state"] == "serving" and one["transitions"][-1]["by"] == "gate"
        assert "Flywheel policy versions" in (await http.get("/dashboard")).text
        metrics = (await http.get("/metrics", headers=ADMIN)).text
        assert 'flywheel_version_state{line="",state="serving",version="1"} 1.0' in metrics
        assert 'flywheel_version_state{line="",state="retired",version="0"} 1.0' in metrics


async def _serving(serve: ServeLoop, version: int) -> bool:
    return serve.pool.weight_version == version


def test_versions_adapters_lists_a_tenants_and_a_users_adapters(tmp_path):
    """`flywheel versions adapters` reads the adapter store: every adapter, a tenant's own and its
    users' (not another tenant's whose name starts the same), or one user's, newest version first."""
    ada, bob = user_adapter("acme", "ada"), user_adapter("acme", "bob")
    for name, versions in ((ada, (1, 2)), (bob, (1,)), ("acme", (3,)), ("acme2", (1,))):
        for version in versions:
            (tmp_path / "adapters" / name / f"v{version}").mkdir(parents=True)
            (tmp_path / "adapters" / name / f"v{version}" / "adapter_model.safetensors").write_bytes(b"\0" * 1000)

    def listed(*args: str) -> str:
        done = subprocess.run([*command("versions", "adapters", f"run_dir={tmp_path}"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    everything, acme, hers = listed(), listed("--tenant", "acme"), listed("--tenant", "acme", "--user", "ada")
    assert all(name in everything for name in (ada, bob, "acme2"))
    assert ada in acme and bob in acme and "acme2" not in acme
    assert ada in hers and "v2 v1" in hers and bob not in hers
