"""The rollout driver: AReaL's admission rule, heavy-tailed generation lengths, the data position
(tasks drawn, RNGs) a restarted driver continues from, and its admission counter, which a
restarted driver keeps (a driver run against the real gateway, stopped, and started again)."""

import asyncio
import random
from collections import Counter

import pytest

from flywheel.bus import TRAFFIC_SUBJECTS, WEIGHTS_SUBJECT, Turn, WeightUpdate
from flywheel.config import ConfigError, load_config
from flywheel.envs import make_env
from flywheel.models import WeightStore, load_model
from flywheel.rollout.driver import RolloutDriver
from flywheel.runtime import cancel_and_wait, repeat

from waiting import until


def driver(tmp_path, *overrides: str) -> RolloutDriver:
    return RolloutDriver(load_config(None, [f"run_dir={tmp_path}", "rollout.endpoint=http://127.0.0.1:9", *overrides]), "nats://unused")


def test_admission_keeps_accepted_plus_running_within_the_staleness_bound(tmp_path):
    d = driver(tmp_path, "rollout.max_head_offpolicyness=1", "train.batch_size=8", "rollout.max_concurrent_rollouts=100")
    d.version, d.accepted, d.running = 0, 8, 4  # bound (1 + 0 + 1) * 8 = 16
    assert d.capacity(4) and not d.capacity(5)
    d.version = 1  # bound 24
    assert d.capacity(12) and not d.capacity(13)
    d.config.rollout.max_concurrent_rollouts = 10
    assert d.capacity(6) and not d.capacity(7)  # the concurrency cap binds first


def test_heavy_tailed_lengths_stay_in_bounds_and_have_a_tail(tmp_path):
    d = driver(tmp_path, "rollout.sampling.length_tail=1.0", "rollout.sampling.min_new_tokens=8", "rollout.sampling.max_new_tokens=256")
    lengths = [d.draw_length() for _ in range(20_000)]
    assert min(lengths) == 8 and max(lengths) <= 256
    share_long = sum(n >= 128 for n in lengths) / len(lengths)
    assert share_long == pytest.approx((8 / 128 - 8 / 256) / (1 - 8 / 256), abs=0.006)  # Pareto tail, truncated
    assert sorted(lengths)[len(lengths) // 2] < 20  # most are short


def test_a_driver_continues_the_task_sequence_of_its_run_dir(tmp_path):
    first = driver(tmp_path / "run", "rollout.env=arithmetic")
    drawn = [first.env.reset(first.rng).id for _ in range(3)]
    first.tasks_drawn = 3
    first._save_state()
    expected_next = first.env.reset(first.rng).id
    for resume in ("true", "false"):  # a Ray restart within a run does not set train.resume
        again = driver(tmp_path / "run", "rollout.env=arithmetic", f"train.resume={resume}")
        assert again.tasks_drawn == 3 and again.env.reset(again.rng).id == expected_next
    fresh = driver(tmp_path / "other", "rollout.env=arithmetic")
    assert fresh.tasks_drawn == 0 and fresh.env.reset(fresh.rng).id == drawn[0]  # no state file: from the start


def test_environment_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.env: unknown environment"):
        driver(tmp_path, "rollout.env=nope")
    with pytest.raises(ConfigError, match="rollout.env_args: arithmetic takes no argument"):
        driver(tmp_path, "rollout.env=arithmetic", "rollout.env_args={bogus: 1}")


async def test_a_restarted_driver_keeps_its_admission_count_and_data_position(served, nats_url, bus, tmp_path):
    """η = 0, B = 4, groups of 2: the first driver admits (0 + 0 + 1)·4 samples and waits for
    version 1. Restarted on the same run_dir (train.resume false, as under a Ray restart), the
    driver counts those 4 as accepted, so version 1 lets in 4 more, not 8, and it draws the tasks
    and generation lengths the first one would have drawn next."""
    gateway = served
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", "rollout.env=arithmetic", "rollout.sampling.n_samples=2",
                                "train.batch_size=4", "rollout.max_head_offpolicyness=0", "rollout.sampling.length_tail=1.0",
                                "rollout.sampling.max_new_tokens=8"])
    assert not config.train.resume
    first = RolloutDriver(config, nats_url, gateway.url)
    await first.start()
    await until(lambda: first.accepted + first.failed == 4 and first.running == 0)
    await first.stop()
    assert first.accepted == 4 and first.tasks_drawn == 2 and not first.capacity(2)

    second = RolloutDriver(config, nats_url, gateway.url)
    restored = second.tasks_drawn
    assert (second.accepted, second.running, restored) == (4, 0, 2)  # (a)
    assert second.length_rng.getstate() == first.length_rng.getstate()
    assert not second.capacity(2)  # version 0 admits no more than it did for the first driver
    path = WeightStore(tmp_path / "store").publish(load_model("tiny")[0], 1)
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="weights-v1", version=1, path=str(path), step=1))
    await second.start()
    await until(lambda: second.accepted + second.failed == 8 and second.running == 0)
    await second.stop()
    assert second.version == 1 and second.accepted == 8 and not second.capacity(2)
    assert second.tasks_drawn - restored == 2  # (b): (0 + 1 + 1)·4 = 8 samples in all, 4 of them before the restart

    env, rng = make_env("arithmetic", {}), random.Random(config.seed)
    run_tasks = [env.reset(rng).id for _ in range(4)]
    sessions: dict[str, str] = {}
    traffic = bus.consumer(TRAFFIC_SUBJECTS, "watch")

    async def eight_sessions_recorded() -> bool:
        sessions.update((d.record.session_id, d.record.task_id) for d in await traffic.fetch(timeout_s=1)
                        if isinstance(d.record, Turn))
        return len(sessions) >= 8

    await until(eight_sessions_recorded)
    # (c): the restarted driver went on with the run's third and fourth tasks, not its first two again
    assert Counter(sessions.values()) == {task: 2 for task in run_tasks}


class HoldingLast:
    """The driver's real runner, except that each group's last episode never ends: a driver that
    dies while it runs."""

    def __init__(self, runner, group_size: int):
        self.runner, self.group_size = runner, group_size

    async def run(self, task, session_id: str, **turn):
        if session_id.startswith(f"{task.id}-{self.group_size - 1}-"):
            await asyncio.Event().wait()
        return await self.runner.run(task, session_id, **turn)

    async def close(self) -> None:
        await self.runner.close()


async def test_a_group_cut_short_by_the_drivers_death_uses_no_admission_slot(served, nats_url, tmp_path):
    """η = 0, B = 4, one group of 4 whose last episode is still running when the driver dies: the
    three verdicts reported reach the trainer as a group of 3 that times out incomplete, never a
    batch of 4. Had they been counted, the restarted driver (3 accepted, bound 4) could start no
    group and the trainer would wait for ever (a resumed `flywheel train` hung so in CI)."""
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", "rollout.env=arithmetic", "rollout.sampling.n_samples=4",
                                "train.batch_size=4", "rollout.max_head_offpolicyness=0", "rollout.sampling.max_new_tokens=8"])
    first = RolloutDriver(config, nats_url, served.url)
    await first.start()
    first.runner = HoldingLast(first.runner, 4)
    await until(lambda: len(first.recent_rewards) == 3)
    await first.stop()
    second = RolloutDriver(config, nats_url, served.url)
    assert (second.accepted, second.tasks_drawn) == (0, 1)
    assert second.capacity(4)


async def test_admission_rises_only_once_the_endpoint_serves_the_announced_version(served, nats_url, bus, tmp_path):
    """A version announced is not yet served: the gateway still loads it. An episode admitted for
    it before then runs on the version before (tiny answers in tens of milliseconds), and at η = 0
    the trainer drops it as stale while its admission slot is never given back: flywheel train at η = 0
    stopped for good (1 run in 2 here). The driver's bound rises once the endpoint reports it."""
    config = load_config(None, [f"run_dir={tmp_path / 'run'}", "rollout.env=arithmetic", "rollout.max_head_offpolicyness=0"])
    d = RolloutDriver(config, nats_url, served.url)
    served_when_admitted: list[int] = []

    async def watch() -> None:  # woken by each change of version: the served version at that moment
        while d.version < 1:
            d._changed.clear()
            await d._changed.wait()
        served_when_admitted.append(served.pool.weight_version)

    d.bus = bus
    follower = asyncio.create_task(d._follow_versions())
    watcher = asyncio.create_task(watch())
    path = await asyncio.to_thread(WeightStore(tmp_path / "store").publish, load_model("tiny")[0], 1)
    await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="weights-v1", version=1, path=str(path), step=1))
    await asyncio.wait_for(watcher, 60)
    follower.cancel()
    assert served_when_admitted == [1]


async def test_a_driver_under_promotion_stops_though_a_follower_swallows_its_cancellation(bus, tmp_path, monkeypatch):
    """Under promotion the driver follows the routing and the trainer's directive in tasks of their
    own. A library may swallow a cancellation once (nats-py's flush, gh-86296), and stopping cancels
    again until every task ends (`cancel_and_wait`); with the followers in an asyncio.TaskGroup a
    second cancellation never reached them: the group, already aborting, waited on, and a
    deployment's stop hung until its 300 s bound killed the driver (the gate test, in a fresh
    clone's full suite)."""
    d = RolloutDriver(load_config("configs/local.yaml", [f"run_dir={tmp_path}", "rollout.endpoint=http://127.0.0.1:9"]), "nats://unused")
    d.bus = bus
    following, swallowed = [], []

    async def stubborn_follow(subject: str, **_):
        following.append(subject)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.append(subject)
            await asyncio.Event().wait()
        yield

    monkeypatch.setattr(bus, "follow", stubborn_follow)
    versions = asyncio.create_task(repeat(d._follow_versions, "rollout.versions"))
    await until(lambda: len(following) == 2)
    await asyncio.wait_for(cancel_and_wait([versions]), 20)
    assert sorted(swallowed) == sorted(following) and versions.cancelled()
