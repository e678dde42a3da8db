"""Episodes through the real endpoint: a multi-turn episode is one exact trajectory carrying its
grade, and an environment worker that dies fails its own episode (reported unscored, with the
reason) while the pool keeps serving."""

import asyncio
import os
import random
import signal

from flywheel.envs import make_env
from flywheel.envs.base import RETRY
from flywheel.rollout.env_pool import LocalRunner, RayEnvPool

from bus_reading import collected, recorded_turns
from factories import assert_segment_is_exact, freeze, platform
from waiting import until

ARITHMETIC = ["rollout.env=arithmetic", "rollout.env_args={max_operand: 20, attempts: 3}", "rollout.sampling.max_new_tokens=8"]


async def test_a_multi_turn_episode_is_one_exact_trajectory_with_its_grade(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *ARITHMETIC) as (serve, collect, _):
        env = make_env("arithmetic", {"max_operand": 20, "attempts": 3})
        runner = LocalRunner(serve.config, env, serve.url, serve.model_name)
        rng = random.Random(0)
        tasks = [env.reset(rng) for _ in range(4)]
        results = await asyncio.gather(*(runner.run(task, f"episode-{i}") for i, task in enumerate(tasks)))
        await runner.close()
        trajectories, turns = await collected(bus, len(results), sum(r.turns for r in results))
    assert any(r.turns > 1 for r in results), "a random model should need more than one attempt somewhere"
    for task, result in zip(tasks, results):
        trajectory = trajectories[result.session_id]
        assert result.reward in (0.0, 1.0) and result.end == "done"
        assert [t.turn_index for t in trajectory.turns] == list(range(result.turns))
        [segment] = trajectory.segments  # the whole episode is one sequence: retries are prompt tokens
        assert_segment_is_exact(segment, turns[result.session_id])
        assert trajectory.task_id == task.id
        [feedback] = trajectory.feedback
        assert feedback.source == "env" and feedback.reward == result.reward
        assert feedback.details["attempts"] == result.turns and feedback.details["turns"] == result.turns
        if result.turns > 1:  # the retry request is in the prompt of the next turn
            assert turns[result.session_id][1].messages[-1] == {"role": "user", "content": RETRY}


async def test_a_dead_env_worker_fails_its_own_episode_and_the_pool_goes_on(nats_url, tmp_path, bus, ray_session):
    overrides = ["rollout.env=arithmetic", "rollout.env_args={max_operand: 20, attempts: 200}",
                 "rollout.episode.max_turns=40", "rollout.sampling.max_new_tokens=8", "rollout.n_parallel_envs=1"]
    async with platform(nats_url, tmp_path, *overrides) as (serve, collect, _):
        pool = RayEnvPool(serve.config, serve.url, serve.model_name)
        pid = await pool.workers[0].pid.remote()
        env = make_env("arithmetic", {"max_operand": 20, "attempts": 200})
        rng = random.Random(1)
        doomed = asyncio.create_task(pool.run(env.reset(rng), "doomed"))
        await recorded_turns(bus, 1, durable="watch-doomed")  # the episode is under way once its first turn is recorded
        os.kill(pid, signal.SIGKILL)
        failed = await doomed
        assert failed.reward is None and "died" in failed.end
        after = await pool.run(env.reset(rng), "after")
        assert after.reward is not None  # the restarted worker serves the next episode
        assert await pool.workers[0].pid.remote() != pid
        await pool.close()
        trajectories, _ = await collected(bus, 2, 0)
    assert trajectories["doomed"].feedback[-1].reward is None
    assert "episode failed: environment worker died" in trajectories["doomed"].feedback[-1].text
    assert trajectories["after"].feedback[-1].reward == after.reward


async def test_a_worker_that_does_not_answer_in_time_is_replaced(nats_url, tmp_path, bus, ray_session):
    """Past twice `episode.timeout_s` without an answer (here: its process is frozen with
    SIGSTOP), the pool treats its worker as hung: the episode is reported unscored with the
    reason and the worker is killed and restarted."""
    overrides = [*ARITHMETIC, "rollout.n_parallel_envs=1", "rollout.episode.timeout_s=0.5"]
    async with platform(nats_url, tmp_path, *overrides) as (serve, collect, _):
        pool = RayEnvPool(serve.config, serve.url, serve.model_name)
        pid = await pool.workers[0].pid.remote()
        env = make_env("arithmetic", {"max_operand": 20, "attempts": 3})
        freeze(pid)
        stuck = await pool.run(env.reset(random.Random(2)), "stuck")
        assert stuck.reward is None and "hung" in stuck.end and pool.worker_failures == 1
        await until(lambda: len(pool._slots) > 0)  # the slot comes back once the restarted worker answers
        assert await pool.workers[0].pid.remote() != pid  # a fresh process took the slot
        await pool.close()
