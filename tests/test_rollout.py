"""The rollout driver's pure parts: AReaL's admission rule, heavy-tailed generation lengths, and
the data position (tasks drawn, RNG) that a resumed run continues from."""

import pytest

from config import ConfigError, load_config
from rollout.driver import RolloutDriver


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
    d = driver(tmp_path, "gconfig.length_tail=1.0", "gconfig.min_new_tokens=8", "gconfig.max_new_tokens=256")
    lengths = [d.draw_length() for _ in range(20_000)]
    assert min(lengths) == 8 and max(lengths) <= 256
    share_long = sum(n >= 128 for n in lengths) / len(lengths)
    assert share_long == pytest.approx((8 / 128 - 8 / 256) / (1 - 8 / 256), abs=0.006)  # Pareto tail, truncated
    assert sorted(lengths)[len(lengths) // 2] < 20  # most are short


def test_a_resumed_driver_continues_the_task_sequence(tmp_path):
    first = driver(tmp_path, "rollout.env=arithmetic")
    drawn = [first.env.reset(first.rng).id for _ in range(3)]
    first.tasks_drawn = 3
    first._save_position()
    expected_next = first.env.reset(first.rng).id
    resumed = driver(tmp_path, "rollout.env=arithmetic", "train.resume=true")
    assert resumed.tasks_drawn == 3 and resumed.env.reset(resumed.rng).id == expected_next
    fresh = driver(tmp_path, "rollout.env=arithmetic")
    assert fresh.env.reset(fresh.rng).id == drawn[0]  # without resume: from the start


def test_environment_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.env: unknown environment"):
        driver(tmp_path, "rollout.env=nope")
    with pytest.raises(ConfigError, match="rollout.env_args: arithmetic takes no argument"):
        driver(tmp_path, "rollout.env=arithmetic", "rollout.env_args={bogus: 1}")
