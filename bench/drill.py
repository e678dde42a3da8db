"""Fault drills: the four loops as processes of their own on one nats-server, agents talking to
the gateway, kill -9 of a component under that load, and an audit of what came out.

`Cluster` runs nats-server (its data on disk, restartable on the same port), or a JetStream
cluster of three (`flywheel.bus.cluster`, every stream replicated three times), and `python -m
serve|collect|judge|train` over it, each killable with SIGKILL and restartable. `agents` drives
multi-turn sessions through the official `openai` client (each session: `turns` chat turns that
resend the growing history, then a reward as feedback), grouped into task groups with
`X-Task-Id` and `X-Group-Size`, until told to stop, and counts every 5xx the clients saw
(retried or not). `audit`
reads the streams and the trainer's ledger and says, for the sessions the clients were told
were recorded (every turn and the feedback answered 200):

- `lost`: no trajectory; `truncated`: a trajectory missing a turn or the feedback;
- `duplicated`: more than one trajectory for a session, or a trajectory twice in the stream;
- samples twice in the stream, samples trained twice in the weights' lineage, and whether the
  announced versions only grew.

`python -m bench.fault_drill` runs it for each component; tests/test_fault_drills.py runs a
small one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import openai

from flywheel.bus.cluster import LocalNatsCluster, free_port
from flywheel.bus.embedded import EmbeddedNats
from flywheel.cli import command

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ("serve", "collect", "judge", "train")


class Cluster:
    """nats-server (or a JetStream cluster of `nats_nodes` members, `bus.replicas=3`) plus the
    loops as processes, all sharing `run_dir`, with `gateways` serve processes (`serve`,
    `serve-1`, ...: each its own port and spill directory). Each gateway has its embedded
    engine, or with `engines` > 0 all share that many `flywheel engine` processes
    (`engine-0`, ...): `serve` swaps their weights, the others follow. Victims: a loop's, a
    gateway's or an engine's name, `nats` (the one server), or `nats-0`, `nats-1`, ... (cluster
    members)."""

    def __init__(self, run_dir: Path, overrides: list[str], nats_nodes: int = 1, gateways: int = 1, engines: int = 0):
        self.run_dir = run_dir
        self.gateways = ["serve"] + [f"serve-{i}" for i in range(1, gateways)]
        self.serve_ports = {name: free_port() for name in self.gateways}
        self.engine_ports = {f"engine-{i}": free_port() for i in range(engines)}
        self.engine_urls = [f"http://127.0.0.1:{port}" for port in self.engine_ports.values()]
        if nats_nodes > 1:
            self.nats = LocalNatsCluster(run_dir / "nats", nats_nodes)
            self.bus_url = self.nats.url
            overrides = [*overrides, "bus.replicas=3"]
        else:
            self.nats = EmbeddedNats(run_dir / "nats", port=free_port())
            self.bus_url = f"nats://127.0.0.1:{self.nats.port}"
        self.overrides = ["serve.torch_threads=1", *overrides]  # the loops share this machine, as a Deployment's do
        self.serve_urls = [f"http://127.0.0.1:{port}" for port in self.serve_ports.values()]
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: Counter[str] = Counter()

    def start_nats(self) -> None:
        self.nats.start()

    def start(self, kind: str) -> None:
        if kind.startswith("nats-"):
            self.nats.restart(int(kind.removeprefix("nats-")))
            return
        if kind == "nats":
            self.start_nats()
            return
        log = (self.run_dir / f"{kind}.log").open("a")
        if kind in self.engine_ports:
            args = [*command("engine"), "--port", str(self.engine_ports[kind]), "--weight-version", "0",
                    "--max-running-requests", "16", "--torch-threads", "1"]
        else:
            gateway = [f"serve.port={self.serve_ports[kind]}", f"serve.spill_dir={self.run_dir / 'spill' / kind}"] \
                if kind in self.serve_ports else []
            if kind in self.serve_ports and self.engine_urls:
                gateway += [f"serve.engine_urls={json.dumps(self.engine_urls)}", f"serve.swap_weights={kind == 'serve'}"]
            loop = kind.partition("-")[0]
            args = [*command(*(["serve"] if loop == "serve" else ["loop", loop])), f"bus.url={self.bus_url}",
                    f"run_dir={self.run_dir}", *gateway, *self.overrides]
        self.procs[kind] = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, kind: str) -> None:
        """SIGKILL: no cleanup of any kind."""
        if kind.startswith("nats-"):
            self.nats.kill(int(kind.removeprefix("nats-")))
        elif kind == "nats":
            self.nats.kill()
        else:
            os.kill(self.procs[kind].pid, signal.SIGKILL)
            self.procs[kind].wait()

    def restart(self, kind: str) -> None:
        self.restarts[kind] += 1
        self.start(kind)

    async def back(self, kind: str) -> None:
        """Until a restarted cluster member serves JetStream again and has caught up (a loop or
        the one server: at once)."""
        if kind.startswith("nats-"):
            await asyncio.to_thread(self.nats.wait_healthy, int(kind.removeprefix("nats-")))

    def engine_loads(self) -> dict[str, list[str]]:
        """The weight versions each shared engine loaded, in order (from its log)."""
        return {kind: re.findall(r"weights '([^']*)' loaded", (self.run_dir / f"{kind}.log").read_text())
                for kind in self.engine_ports}

    def alive(self) -> dict[str, bool]:
        return {kind: proc.poll() is None for kind, proc in self.procs.items()}

    async def wait_serving(self, timeout_s: float = 180.0, urls: list[str] | None = None) -> None:
        """Until every gateway (or every one of `urls`) answers `/health`."""
        deadline = time.monotonic() + timeout_s
        urls = self.serve_urls if urls is None else urls
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    if all([(await http.get(f"{url}/health")).status_code == 200 for url in urls]):
                        return
                except httpx.HTTPError:
                    pass
                dead = [k for k, up in self.alive().items() if not up]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not come up (dead: {dead}); see {self.run_dir}/*.log")
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.stop()


@dataclass
class Load:
    """What the agents saw."""

    answered: set[str] = field(default_factory=set)
    """Sessions whose every turn and feedback got a 200."""
    failed: dict[str, str] = field(default_factory=dict)
    server_errors: int = 0
    """5xx responses the clients received (including ones their retries hid)."""
    requests: int = 0


class Balancer(httpx.AsyncBaseTransport):
    """A load balancer in front of several gateways. Session-blind (`by_session` false): each
    request goes to the next gateway in turn. By session: a request goes to the gateway its
    session id (the `X-Session-Id` header, or the id in a `/v1/sessions/{id}/...` path) ranks
    first by rendezvous hashing, as ingress-nginx's `upstream-hash-by` does with a consistent
    hash. Either way a gateway that refuses connections is skipped for the next (what a
    balancer's health checks and retries do)."""

    def __init__(self, urls: list[str], by_session: bool = False):
        self.targets = [httpx.URL(url) for url in urls]
        self.by_session = by_session
        self.inner = httpx.AsyncHTTPTransport()
        self.turn = 0

    def _order(self, request: httpx.Request) -> list[httpx.URL]:
        session = request.headers.get("x-session-id")
        if session is None and request.url.path.startswith("/v1/sessions/"):
            session = request.url.path.split("/")[3]
        if self.by_session and session is not None:
            return sorted(self.targets, key=lambda t: hashlib.blake2b(f"{t}\0{session}".encode()).digest(), reverse=True)
        self.turn += 1
        return self.targets[self.turn % len(self.targets):] + self.targets[: self.turn % len(self.targets)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for target in self._order(request):
            request.url = request.url.copy_with(host=target.host, port=target.port)
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError:
                continue
        raise httpx.ConnectError("no gateway accepts connections", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def agents(urls: list[str], stop: asyncio.Event, turns: int, concurrency: int, group_size: int, round_to: int,
                 tag: str = "s", by_session: bool = False, min_sessions: int = 0) -> Load:
    """Run multi-turn sessions through the gateways at `urls` (`Balancer`, by session or not),
    `concurrency` at a time, until `stop` is set and at least `min_sessions` have ended (answered
    or failed: a count of work, not of seconds, so a slower machine runs the same drill longer);
    then only until the count of sessions is a multiple of `round_to` (whole groups and training
    batches)."""
    load = Load()
    url = urls[0]

    async def count(response: httpx.Response) -> None:
        load.requests += 1
        if response.status_code >= 500:
            load.server_errors += 1

    http = httpx.AsyncClient(base_url=url, timeout=120, event_hooks={"response": [count]}, transport=Balancer(urls, by_session))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="drill", max_retries=10, http_client=http)
    started = iter(range(10**9))

    async def session(i: int) -> None:
        sid, task = f"{tag}{i}", f"{tag}-task{i // group_size}"
        headers = {"X-Session-Id": sid, "X-Task-Id": task, "X-Group-Size": str(group_size)}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count from {i}."}]
        try:
            for turn in range(turns):
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                             extra_headers=headers)
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"and {turn}?"}]
            for attempt in range(20):
                try:
                    response = await http.post(f"/v1/sessions/{sid}/feedback", json={"reward": (i % 3) / 2, "source": "env"})
                    if response.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
            else:
                raise RuntimeError("feedback was never answered 200")
            load.answered.add(sid)
        except Exception as exc:
            load.failed[sid] = f"{type(exc).__name__}: {exc}"

    limit: int | None = None

    async def worker() -> None:
        nonlocal limit
        for i in started:
            if stop.is_set() and (limit is not None or len(load.answered) + len(load.failed) >= min_sessions):
                limit = limit if limit is not None else -(-i // round_to) * round_to
                if i >= limit:
                    return
            await session(i)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return load


async def read_stream(bus: Any, stream: str, kind: type) -> list[Any]:
    """Every record in a stream, in order (gets by sequence)."""
    from nats.js.errors import NotFoundError

    from flywheel.bus import decode
    from flywheel.bus.large import read_payload

    info = await bus.js.stream_info(stream)
    records = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await bus.get_message(stream, seq)
        except NotFoundError:  # deleted or expired
            continue
        records.append(decode(await read_payload(bus, raw.data, raw.headers), kind))
    return records


async def audit(bus_url: str, run_dir: Path, load: Load, turns: int) -> dict[str, Any]:
    from flywheel.bus import Bus, Sample, Trajectory, WeightUpdate
    from flywheel.train.ledger import lineage

    bus = await Bus.connect(bus_url, name="audit", ensure_streams=False)
    try:
        trajectories = await read_stream(bus, "TRAJECTORIES", Trajectory)
        samples = await read_stream(bus, "SAMPLES", Sample)
        updates = await read_stream(bus, "WEIGHTS", WeightUpdate)
        replicas = (await bus.js.stream_info("TRAFFIC")).config.num_replicas
    finally:
        await bus.close()
    by_session: dict[str, list[Any]] = defaultdict(list)
    for trajectory in trajectories:
        by_session[trajectory.session_id].append(trajectory)
    complete = truncated = lost = 0
    for sid in load.answered:
        found = by_session.get(sid, [])
        if not found:
            lost += 1
            continue
        indices = {t.turn_index for t in found[0].turns}
        rewarded = any(e.reward is not None for e in found[0].feedback)
        if indices >= set(range(turns)) and rewarded:
            complete += 1
        else:
            truncated += 1
    trajectory_copies = Counter(t.id for t in trajectories)
    sample_copies = Counter(s.id for s in samples)
    ledger = run_dir / "trained.jsonl"
    trained = Counter(sid for step in lineage(ledger) for sid in step["samples"]) if ledger.exists() else Counter()
    versions = [u.version for u in updates]
    answered = [by_session[sid][0] for sid in load.answered if by_session.get(sid)]
    return {
        "segments_per_trajectory": round(sum(len(t.segments) for t in answered) / max(len(answered), 1), 2),
        "stream_replicas": replicas,
        "sessions_answered": len(load.answered),
        "sessions_failed": len(load.failed),
        "requests": load.requests,
        "server_errors": load.server_errors,
        "complete": complete,
        "lost": lost,
        "truncated": truncated,
        "duplicated_sessions": sum(1 for sid in load.answered if len(by_session.get(sid, [])) > 1),
        "duplicated_trajectories": sum(n - 1 for n in trajectory_copies.values()),
        "samples": len(sample_copies),
        "duplicated_samples": sum(n - 1 for n in sample_copies.values()),
        "trained": len(trained),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "versions_increasing": all(a < b for a, b in zip(versions, versions[1:])),
        "versions": versions[-1] if versions else None,
    }


BATCH = 8
DRILL_CONFIG = [
    "bus.ack_wait_s=3", "collect.feedback_grace_s=1", f"train.batch_size={BATCH}", "train.group_timeout_s=30",
    "train.checkpoint_interval=3", "rollout.max_head_offpolicyness=1000", "serve.max_batch_size=16",
    "judge.teacher.enabled=false",
]
"""Short waits so a drill takes seconds; no staleness drops, so every sample must be trained; the
agents' feedback is rewards without words, so no hint teacher (nor its server). The
group timeout is long enough for a group's last member to come back from redelivery or the
gateway's spill file after a kill: a group split by its timeout leaves a partial batch behind."""


async def drill(run_dir: Path, victims: list[str], turns: int = 3, concurrency: int = 8, group_size: int = 4,
                every_s: float = 3.0, down_s: float = 1.5, settle_s: float = 90.0, nats_nodes: int = 1,
                gateways: int = 1, by_session: bool = False, engines: int = 0, min_sessions: int = 0) -> dict[str, Any]:
    """Start the cluster, put it under the agents' load, kill -9 each victim in turn (`every_s`
    apart, down for `down_s`, then restarted and back), keep the load on for `every_s` more and
    until `min_sessions` sessions have ended, and audit once everything has settled."""
    cluster = Cluster(run_dir, DRILL_CONFIG, nats_nodes, gateways, engines)
    cluster.start_nats()
    try:
        for kind in cluster.engine_ports:
            cluster.start(kind)
        await cluster.wait_serving(urls=cluster.engine_urls)
        for kind in (*cluster.gateways, *LOOPS[1:]):
            cluster.start(kind)
        await cluster.wait_serving()
        started = time.monotonic()
        stop = asyncio.Event()
        load_task = asyncio.create_task(agents(cluster.serve_urls, stop, turns, concurrency, group_size, BATCH,
                                                by_session=by_session, min_sessions=min_sessions))
        for victim in victims:
            await asyncio.sleep(every_s)
            cluster.kill(victim)
            await asyncio.sleep(down_s)
            cluster.restart(victim)
            await cluster.back(victim)
        await asyncio.sleep(every_s)
        stop.set()
        load = await load_task
        load_s = time.monotonic() - started
        deadline = time.monotonic() + settle_s
        audit_retries = 0
        while True:  # until every answered session is trained (all groups fill: nothing is left waiting)
            try:
                report = await audit(cluster.bus_url, run_dir, load, turns)
            except nats.errors.Error:  # a JetStream API request refused or unanswered while the cluster settles
                audit_retries += 1
                await asyncio.sleep(1.0)
                continue
            if report["trained"] >= len(load.answered) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        loads = cluster.engine_loads()
        return {"victims": victims, "load_s": round(load_s, 1), "settled_s": round(time.monotonic() - started, 1),
                "alive": cluster.alive(), "audit_retries": audit_retries, **report,
                "engine_loads": {kind: len(versions) for kind, versions in loads.items()},
                "engine_last_version": {kind: versions[-1] if versions else "0" for kind, versions in loads.items()},
                "engine_duplicate_loads": sum(len(v) - len(set(v)) for v in loads.values())}
    finally:
        cluster.stop()
