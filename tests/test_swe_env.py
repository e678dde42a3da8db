"""The `swe` environment: the coding agent's protocol over a real sandbox, graded by the task's
tests; an episode through the real endpoint becoming one multi-turn trajectory with its grade;
and `flywheel train` on SWE tasks (`swe_tiny`) through all four loops."""

import json
import random
import subprocess
from pathlib import Path

import pytest

from flywheel.cli import command
from flywheel.envs import make_env
from flywheel.envs.sandbox.bubblewrap import default_uid_base
from flywheel.envs.swe.agent import SUBMIT_MARKER, parse_action
from flywheel.rollout.env_pool import LocalRunner

from bus_reading import collected
from factories import assert_segment_is_exact, platform

ROOT = Path(__file__).resolve().parent.parent


def bash(command: str) -> str:
    return f"THOUGHT: next step.\n```bash\n{command}\n```"


@pytest.fixture(scope="module")
def swe():
    return make_env("swe", {"difficulty": ["easy"]})


def test_replies_become_one_command_or_a_format_reminder():
    assert parse_action(bash("ls -la")).command == "ls -la"
    assert parse_action("```sh\ncat setup.cfg\n```").command == "cat setup.cfg"
    for bad in ("no block at all", bash("ls") + "\n" + bash("pwd"), "```bash\n\n```", "```python\nprint(1)\n```"):
        action = parse_action(bad)
        assert action.command is None and "exactly one ```bash block" in action.error


def test_a_scripted_fix_resolves_the_task_and_doing_nothing_does_not(swe):
    task = swe.reset(random.Random(3))
    record = swe.tasks[task.info["instance_id"]]
    episode = swe.open(task, slot=1)
    try:
        seen = episode.step(bash("id -u && git log --oneline | wc -l && ls"))
        output = seen.messages[0]["content"]
        assert "<returncode>0</returncode>" in output and f"{default_uid_base() + 1}\n1\n" in output  # slot 1's uid; one commit
        assert "exactly one" in episode.step("I will think first.").messages[0]["content"]
        applied = episode.step(bash(f"git apply <<'PATCH'\n{record.patch}PATCH"))
        assert not applied.done and "<returncode>0</returncode>" in applied.messages[0]["content"]
        assert episode.step(bash(f"echo {SUBMIT_MARKER}")).done
        grade = episode.finish()
    finally:
        episode.close()
    assert grade.reward == 1.0 and grade.details["resolved"] and grade.details["submitted"]
    assert set(grade.details["FAIL_TO_PASS"]) == set(record.FAIL_TO_PASS) and all(grade.details["FAIL_TO_PASS"].values())
    assert grade.details["commands"] == 3  # the malformed reply ran nothing

    idle = swe.open(task, slot=1)
    try:
        grade = idle.finish()
    finally:
        idle.close()
    assert grade.reward == 0.0 and not grade.details["resolved"] and not any(grade.details["FAIL_TO_PASS"].values())


def test_slots_numbered_alike_under_two_uid_bases_keep_their_episodes_apart(monkeypatch):
    """Two test workers (or rollout processes) both number their slots from 0: their uid bases
    keep their sandboxes apart, and so must they keep their episodes' working copies (an episode
    empties its slot's copy first)."""
    episodes = []
    try:
        for base in (40000, 50000):
            monkeypatch.setenv("FLYWHEEL_SANDBOX_UID_BASE", str(base))
            env = make_env("swe", {"difficulty": ["easy"]})
            episodes.append(env.open(env.reset(random.Random(3)), slot=2))
        first, second = episodes
        assert first.workdir != second.workdir
        assert "<returncode>0</returncode>" in first.step(bash("git status --short | wc -l")).messages[0]["content"]
    finally:
        for episode in episodes:
            episode.close()


async def test_an_episode_through_the_endpoint_is_one_trajectory_graded_by_the_tests(nats_url, tmp_path, bus, swe):
    overrides = ["rollout.env=swe", "rollout.episode.max_turns=3", "rollout.sampling.max_new_tokens=16"]
    async with platform(nats_url, tmp_path, *overrides) as (serve, collect, _):
        runner = LocalRunner(serve.config, swe, serve.url, serve.model_name)
        task = swe.reset(random.Random(4))
        result = await runner.run(task, "swe-episode")
        await runner.close()
        trajectories, turns = await collected(bus, 1, result.turns)
    assert result.turns == 3 and result.end == "max_turns"  # `tiny` never submits
    trajectory = trajectories["swe-episode"]
    [segment] = trajectory.segments
    assert_segment_is_exact(segment, turns["swe-episode"])
    assert turns["swe-episode"][0].messages == task.messages
    [feedback] = trajectory.feedback
    assert feedback.reward == result.reward == 0.0
    assert feedback.details["instance_id"] == task.info["instance_id"] and feedback.details["turns"] == 3
    assert set(feedback.details["FAIL_TO_PASS"]) == set(swe.tasks[task.info["instance_id"]].FAIL_TO_PASS)


def test_train_run_on_swe_tasks(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([*command("train"), "--config", "configs/swe_tiny.yaml", "--refresh-s", "0.5",
                           f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["n_samples"] == 4 and m["groups_split"] == 0
        assert m["turns_mean"] > 1  # multi-turn trajectories
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["staleness_max"] <= 2
