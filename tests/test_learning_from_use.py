"""Learning from use, end to end through real loops: the judge's own server keeps its weights while
the policy's move (a moving judge is not the default), feedback text reaches the judge and
becomes a hint, and the teacher (the pinned model told the hint) scores exactly the tokens the
policy sampled, with a prefill-only engine request, onto the sample, next to which judge scored."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean

import httpx
import openai
import pytest

from flywheel.bus import (
    SAMPLE_SUBJECT,
    WEIGHTS_SUBJECT,
    Sample,
    Trajectory,
    WeightUpdate,
)
from flywheel.bus.stitch import stitch
from flywheel.config import load_config
from flywheel.deploy.deployment import side_server_config
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.teacher import Teacher, hints_of
from flywheel.models import WeightStore, load_model
from flywheel.serve.loop import ServeLoop
from flywheel.train.advantages import RunningBaseline
from flywheel.train.grouping import Group, Member
from flywheel.train.step_batch import StepBatch

from bus_reading import collected, read, recorded_turns
from factories import make_turn, platform
from waiting import until


def test_the_default_judge_is_pinned_not_the_policy_being_trained():
    config = load_config(None, ["judge.kind=llm"])
    assert config.judge.llm.source == "pinned" and config.judge.needs_server()
    server = side_server_config(config, "judge")
    assert server.serve.role == "judge" and server.model == config.model and server.served_model == config.served_model
    named = side_server_config(load_config(None, ["judge.weights=runs/x/weights/v3"]), "judge")
    assert named.model == "runs/x/weights/v3"


async def test_the_judges_server_keeps_its_weights_while_the_policys_move(nats_url, tmp_path, bus):
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0"])
    policy, judge = ServeLoop(config, nats_url), ServeLoop(side_server_config(config, "judge"), nats_url)
    await policy.start()
    await judge.start()
    try:
        model, _ = load_model("tiny")
        path = WeightStore(tmp_path / "weights").publish(model, 1)
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w1", version=1, path=str(path), step=1))
        await until(lambda: policy.pool.weight_version == 1)  # the announcement reached both
        assert judge.pool.weight_version == 0 and judge.swaps == 0
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{judge.url}/health")).json()["weight_version"] == 0
    finally:
        await judge.stop()
        await policy.stop()


@pytest.mark.parametrize("top_k", [0, 3])
async def test_feedback_text_becomes_a_hint_the_teacher_scores_onto_the_sample(nats_url, tmp_path, bus, top_k):
    """With `judge.teacher.top_k` the teacher's 3 likeliest tokens at each taught position come
    too, on the same positions (token t's at [3t, 3t + 3)), likeliest first."""
    async with platform(nats_url, tmp_path, "judge.kind=rule", "judge.teacher.enabled=true",
                        f"judge.teacher.top_k={top_k}") as (serve, _, client):
        server = ServeLoop(side_server_config(serve.config, "judge"), nats_url)
        await server.start()
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        try:
            messages = [{"role": "user", "content": "Greet me."}]
            headers = {"X-Session-Id": "hinted"}
            first = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=6, temperature=0.8, extra_headers=headers)
            messages += [first.parse().choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
            await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, extra_headers=headers)
            async with httpx.AsyncClient() as http:
                feedback = {"interaction_id": first.headers["x-interaction-id"], "text": "Say my name, Ada, first."}
                (await http.post(f"{serve.url}/v1/sessions/hinted/feedback", json=feedback)).raise_for_status()
                (await http.post(f"{serve.url}/v1/sessions/hinted/feedback", json={"reward": 1.0})).raise_for_status()
            trajectories, _ = await collected(bus, 1, 2)
            samples: list[Sample] = await read(bus, SAMPLE_SUBJECT, "hint-check")
        finally:
            await judge.stop()
            await server.stop()
    trajectory = trajectories["hinted"]
    [sample] = samples
    assert hints_of(trajectory, sample.details) == {0: "Say my name, Ada, first."}
    [segment], [teacher] = trajectory.segments, sample.teacher_logprobs
    (_, start, end), (_, later, _) = segment.turn_spans
    taught = [i for i, v in enumerate(teacher) if not math.isnan(v)]
    assert taught == list(range(start, end)) and later >= end  # the hinted turn's sampled tokens, only
    assert sample.teacher_top_k == top_k
    if top_k:
        [ids], [values] = sample.teacher_top_ids, sample.teacher_top_logprobs
        assert len(ids) == len(values) == top_k * len(segment.token_ids)
        assert [t for t in range(len(segment.token_ids)) if ids[t * top_k] >= 0] == taught
        for t in taught:
            top = values[t * top_k:(t + 1) * top_k]
            assert list(top) == sorted(top, reverse=True) and teacher[t] <= top[0] + 1e-6
    else:
        assert sample.teacher_top_ids == [] and sample.teacher_top_logprobs == []
    # The same numbers straight from the pinned engine: the turn's request with the hint appended.
    told = Teacher(serve.config.judge.teacher, server.url).told(trajectory.turns[0].messages, "Say my name, Ada, first.")
    assert told[-1]["content"].startswith("Greet me.") and "Ada" in told[-1]["content"]
    assert sample.judge == "rule" and sample.judge_model is None


async def test_the_teacher_scores_sampled_tokens_as_the_engine_sampled_them(nats_url, tmp_path, bus):
    """`/engine/score` renders the messages as a request would be and scores the given tokens with a
    prefill-only engine request: for the tokens the same server sampled for those messages, the
    log-probabilities it recorded when sampling."""
    config = load_config(None, [f"run_dir={tmp_path}", "serve.port=0"])
    server = ServeLoop(side_server_config(config, "judge"), nats_url)
    await server.start()
    try:
        asked = [{"role": "user", "content": "Count to three."}]
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        await client.chat.completions.create(model="tiny", messages=asked, max_tokens=8, temperature=0.7)
        [turn] = await recorded_turns(bus, 1)
        async with httpx.AsyncClient(base_url=server.url) as http:
            scored = (await http.post("/engine/score", json={"messages": asked, "output_ids": list(turn.output_ids),
                                                             "temperature": 0.7, "top_k": 4})).json()
            bad = await http.post("/engine/score", json={"messages": [], "output_ids": [1]})
            too_many = await http.post("/engine/score", json={"messages": asked, "output_ids": [1], "top_k": 21})
        assert scored["prompt_tokens"] == len(turn.prompt_ids)
        assert scored["logprobs"] == pytest.approx(list(turn.output_logprobs), abs=1e-4)
        # The teacher's whole distribution at each sampled token's position: its top 4, likeliest first.
        assert len(scored["top_ids"]) == len(scored["top_logprobs"]) == len(turn.output_ids)
        for ids, values, token, value in zip(scored["top_ids"], scored["top_logprobs"], turn.output_ids, scored["logprobs"]):
            assert len(ids) == 4 and values == sorted(values, reverse=True) and value <= values[0] + 1e-6
            assert token not in ids or values[ids.index(token)] == pytest.approx(value, abs=1e-5)
        assert bad.status_code == 400 and too_many.status_code == 400
    finally:
        await server.stop()


def live_sample(verdicts: list[float]) -> Sample:
    """A live session (a group of one) whose k-th reply the next_state judge scored verdicts[k]."""
    turns, prompt = [], [1, 2, 3]
    for k, _ in enumerate(verdicts):
        output = [10 + 2 * k, 11 + 2 * k]
        turns.append(make_turn(id=f"t{k}", turn_index=k, prompt_ids=list(prompt), output_ids=output, output_versions=[0, 0]))
        prompt += output + [9]
    trajectory = Trajectory(id="s1", session_id="s1", segments=stitch(turns), turns=turns, close_reason="idle")
    return Sample(id="s1", trajectory=trajectory, reward=fmean(verdicts), turn_rewards=verdicts, judge="next_state")


def turn_advantages(config, sample: Sample, baseline: float) -> list[float]:
    """The advantage on each sampled token of the (one-segment) sample, in order."""
    running = RunningBaseline()
    running.value = baseline
    [[micro]] = StepBatch([Group(sample.id, 1, 0.0, 0.0, {sample.id: Member(sample, [])})], config, running, 0).minibatches
    return micro.advantages[micro.loss_mask == 1].tolist()


def test_live_traffic_trains_each_reply_on_its_own_next_state_verdict():
    """Live sessions are groups of one, so their outcome's advantage is taken against a running
    baseline: a person who corrects every reply gives −1 every time and, with the outcome alone,
    an advantage of exactly 0 (the personal-agent bench's rl arm trained 20 steps with gradient
    norm 0). The live configuration puts each reply's own verdict into its tokens' advantage,
    undiscounted by the verdicts of later replies: a corrected reply is pushed down even when
    every reply is, and of a corrected reply and a thanked one, the thanked one is pushed up by
    two verdicts more (the session's outcome, the mean verdict, adds alike to both)."""
    config = load_config(Path("configs/live.yaml"), ["actor.ppo_n_minibatches=1"])
    assert config.judge.kind == "next_state"
    corrected_always = turn_advantages(config, live_sample([-1.0]), baseline=-1.0)
    assert corrected_always and max(corrected_always) < 0
    first, _, second, _ = turn_advantages(config, live_sample([-1.0, 1.0]), baseline=-1.0)
    assert second - first == pytest.approx(2.0)
