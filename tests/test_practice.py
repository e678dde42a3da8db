"""Practice (`judge.teacher.practice`): a corrected turn's request answered again by the person's
own adapter on the policy's server, each reply taught by the teacher told the correction, and
published as one group of samples with the engine's exact tokens, log-probs and versions; with
`judge.teacher.practice_history`, the person's earlier requests (never another's) replayed with
the correction too, until the person is forgotten."""

import httpx
import pytest

from flywheel.bus import (
    SAMPLE_SUBJECT,
    WEIGHTS_SUBJECT,
    Sample,
    Trajectory,
    WeightUpdate,
)
from flywheel.bus.instructions import Instructions, placed_before, unplaced
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT, memory_subject
from flywheel.config import load_config
from flywheel.config.loader import ConfigError
from flywheel.config.memory import TEMPLATE
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.practice import corrected_turns
from flywheel.bus.instructions import without_request
from flywheel.judge.teacher import Teacher
from flywheel.judge.wishes import Wish
from flywheel.models import load_model
from flywheel.models.adapter_names import user_adapter

from bus_reading import read
from factories import chat_prompt, platform, recomputed_logprobs, teach_tiny
from peft_adapters import LINEAR, random_adapters
from tenant_traffic import TENANTS_SETUP, converse, hinted_session
from waiting import until

ADA = user_adapter("acme", "ada")
PRACTICE = [*TENANTS_SETUP, "adapters.kind=lora", "adapters.scope=user", "judge.teacher.enabled=true",
            "judge.teacher.practice=3"]
HINT = "Say my name, Ada, first."
SAY_NAME = "Call me Ada."


@pytest.mark.parametrize("reward, hint, checked", [
    ("equal", HINT, None),  # equal rewards: the teacher's term alone moves them
    ("checks", "Too long. Keep it much shorter next time.", ["shorter", "answers"]),  # length and answering, checked
])
async def test_a_corrected_turn_is_practised_by_the_persons_adapter_and_taught_by_the_hint(reward, hint, checked, nats_url,
                                                                                          tmp_path, bus):
    base, tokenizer = load_model("tiny")
    [(adapter, peft)] = random_adapters(tmp_path, {"ada-adapter": (1, {"r": 4, "target_modules": LINEAR})}).values()
    async with platform(nats_url, tmp_path, *PRACTICE, f"judge.teacher.practice_reward={reward}") as (serve, _, _):
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="ada-v1", version=1, path=str(adapter), step=1, adapter=ADA))
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer acme-key"}) as http:
            refused = await http.post("/engine/practice", json={"adapter": ADA, "tenant": "acme", "input_ids": [1, 2], "n": 2})
        assert refused.status_code == 403  # the operator's route: a tenant's key samples no adapter through it
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        try:
            messages = [{"role": "user", "content": "Greet me."}]
            await hinted_session(serve, "corrected", messages, hint, reward=-1.0)
            samples = await read(bus, SAMPLE_SUBJECT, "practice-check", 4)
            counts = dict(judge.practice.counts)
        finally:
            await judge.stop()
    [own] = [s for s in samples if s.judge != "practice"]
    practice = [s for s in samples if s.judge == "practice"]
    assert len(samples) == 4 and own.reward == -1.0
    own_segment = (await bus.resolve(own)) and own.trajectory.segments[0]
    (_, start, _), = own_segment.turn_spans
    context = list(own_segment.token_ids[:start])
    told_ids = chat_prompt(tokenizer, Teacher(serve.config.judge.teacher, serve.url).told(messages, hint))
    assert {s.trajectory.task_id for s in practice} == {f"practice:{own.id}:0"}
    for sample in practice:
        trajectory = sample.trajectory
        [segment], [turn] = trajectory.segments, trajectory.turns
        (_, begin, end), = segment.turn_spans
        output = list(segment.token_ids[begin:end])
        assert (sample.tenant, sample.user_id, sample.consent, trajectory.adapter, turn.adapter) == ("acme", "ada", True, ADA, ADA)
        assert trajectory.group_size == 3 and sample.details["practice_of"] == own.id
        assert list(segment.token_ids[:begin]) == context and output and list(segment.loss_mask[begin:end]) == [1] * len(output)
        assert set(segment.versions[begin:end]) == {1}  # Ada's adapter's version, as a turn of hers records it
        assert list(segment.logprobs[begin:end]) == pytest.approx(recomputed_logprobs(peft, context, output), abs=2e-4)
        [teacher] = sample.teacher_logprobs
        assert list(teacher[begin:end]) == pytest.approx(recomputed_logprobs(base, told_ids, output), abs=2e-4)
        assert turn.messages == messages and turn.response["content"] == tokenizer.decode(output, skip_special_tokens=True)
    # Rewarded by the checks: a reply the request makes likelier under the base model (it answers) above one it
    # does not, and among those that answer the shorter (characters other than spaces) the higher, centred;
    # where they are alike in both the checks cannot tell them apart and the rewards stay equal.
    lengths = [sum(not c.isspace() for c in s.trajectory.turns[0].response["content"]) for s in practice]

    def gain(sample: Sample) -> float:  # how much likelier the request makes the reply, by a forward pass
        [segment], (_, begin, end) = sample.trajectory.segments, sample.trajectory.segments[0].turn_spans[0]
        output = list(segment.token_ids[begin:end])
        return sum(sum(recomputed_logprobs(base, chat_prompt(tokenizer, asked), output)) * sign
                   for asked, sign in ((messages, 1), (without_request(messages), -1)))
    answering = [gain(sample) > 0 for sample in practice]
    told_apart = bool(checked) and any(answering) and (
        not all(answering) or len({n for n, a in zip(lengths, answering) if a}) > 1)
    assert counts == {"turns": 1, "replayed": 0, "samples": 3, "failures": 0, "checked_turns": int(told_apart)}
    assert all(s.details.get("checked") == (checked if told_apart else None) for s in practice)
    assert sum(s.reward for s in practice) == pytest.approx(0.0, abs=1e-9)
    for a, b in [(a, b) for a in range(3) for b in range(3)]:
        better = answering[a] and (not answering[b] or lengths[a] < lengths[b])
        assert (practice[a].reward > practice[b].reward) == (told_apart and better)


async def test_a_correction_is_practised_on_the_persons_earlier_requests_too_until_they_are_forgotten(nats_url, tmp_path,
                                                                                                   bus):
    base, tokenizer = load_model("tiny")
    [(adapter, peft)] = random_adapters(tmp_path, {"ada-adapter": (1, {"r": 4, "target_modules": LINEAR})}).values()
    async with platform(nats_url, tmp_path, *PRACTICE, "judge.teacher.practice_history=2") as (serve, _, _):
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="ada-v1", version=1, path=str(adapter), step=1, adapter=ADA))
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        try:
            await converse(serve, "ada", "ada-earlier", follow_ups=("And another?",))  # approved: its opening remembered
            await converse(serve, "bob", "bob-earlier")  # Bob's: never replayed for Ada
            await until(lambda: judge.scored == 2)
            messages = [{"role": "user", "content": "Greet me."}]
            await hinted_session(serve, "corrected", messages, HINT, reward=-1.0)
            await until(lambda: judge.scored == 3)
            counts = dict(judge.practice.counts)
            samples = {s.id: s for s in await read(bus, SAMPLE_SUBJECT, "history", 9)}
            corrected = next(s for s in samples.values() if s.reward < 0 and s.judge != "practice")
            assert await bus.resolve(corrected)
            again = await judge.practice.samples(corrected.trajectory, {0: Wish([HINT], "words")}, {0})  # judged again after a crash
            await bus.publish(AUDIT_SUBJECT, AuditEntry(id="forget-ada", action="forget", actor="test", target="acme",
                                                        details={"tenant": "acme", "user": "ada"}))
            ada = Trajectory(id="", session_id="", segments=[], turns=[], close_reason="done", tenant="acme", adapter=ADA,
                             user_id="ada")
            await until(lambda: not judge.practice.requests.recall(ada))
            await hinted_session(serve, "after", messages, HINT, reward=-1.0)
            after = [s for s in await read(bus, SAMPLE_SUBJECT, "after", 13) if s.id not in samples]
        finally:
            await judge.stop()
    for sample in samples.values():
        await bus.resolve(sample)
    own = {s.trajectory.session_id.split("/")[-1]: s for s in samples.values() if s.judge != "practice"}  # tenant/session
    earlier = own["ada-earlier"].trajectory

    def context(trajectory: Trajectory) -> list[int]:  # of its opening turn
        segment = trajectory.segments[0]
        _, start, _ = segment.turn_spans[0]
        return list(segment.token_ids[:start])
    replayed = [s for s in samples.values() if s.details.get("replayed")]
    assert {s.trajectory.task_id for s in samples.values() if s.judge == "practice"} == {
        f"practice:{own['corrected'].id}:0", f"practice:{own['corrected'].id}:0:{earlier.turns[0].id}"}
    assert counts["turns"] == 2 and counts["replayed"] == 1 and counts["samples"] == 6 and len(replayed) == 3
    assert sorted(s.id for s in again) == sorted(s.id for s in samples.values() if s.judge == "practice")  # not itself
    told_ids = chat_prompt(tokenizer, Teacher(serve.config.judge.teacher, serve.url).told(earlier.turns[0].messages, HINT))
    for sample in replayed:
        trajectory = sample.trajectory
        [segment], [turn] = trajectory.segments, trajectory.turns
        (_, begin, end), = segment.turn_spans
        output = list(segment.token_ids[begin:end])
        assert sample.details == {"practice_of": own["corrected"].id, "turn": 0, "replayed": earlier.turns[0].id}
        assert list(segment.token_ids[:begin]) == context(earlier) != context(own["bob-earlier"].trajectory)
        assert (sample.user_id, trajectory.adapter, turn.messages) == ("ada", ADA, earlier.turns[0].messages)
        assert list(segment.logprobs[begin:end]) == pytest.approx(recomputed_logprobs(peft, context(earlier), output), abs=2e-4)
        [teacher] = sample.teacher_logprobs  # taught by the correction, told after the earlier request
        assert list(teacher[begin:end]) == pytest.approx(recomputed_logprobs(base, told_ids, output), abs=2e-4)
    # Forgotten: neither her earlier requests nor the corrected one are replayed any more, only the new turn practised.
    assert len(after) == 4 and {s.trajectory.task_id for s in after if s.judge == "practice"} == {
        f"practice:{next(s.id for s in after if s.judge != 'practice')}:0"}


@pytest.mark.parametrize("overrides, key", [
    (["adapters.kind=lora", "judge.teacher.practice=1"], "judge.teacher.practice"),
    (["adapters.kind=lora", "judge.teacher.practice_history=2"], "judge.teacher: practice_history needs practice"),
    (["judge.teacher.practice=4"], "adapters.kind=lora"),
    (["adapters.kind=lora", "memory.enabled=true", "judge.teacher.practice_prompt=bare"],
     "judge.teacher: practice_prompt=bare needs practice"),
    (["adapters.kind=lora", "judge.teacher.practice=4", "judge.teacher.practice_prompt=bare"], "memory.enabled"),
    ([*TENANTS_SETUP[1:], "adapters.kind=lora", "judge.teacher.practice=4"], "serve.admin_key"),
])
def test_practice_settings_that_cannot_work_are_refused_by_name(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


@pytest.mark.parametrize("reward, turn_rewards, corrected", [
    (-1.0, [], {0, 1, 2}),  # the outcome alone: owed to every turn
    (-1.0, [0.0, 1.0, -1.0], {0, 2}),  # an approved turn is not corrected by a bad outcome; one with no reward is
    (1.0, [-1.0, 0.0, 1.0], {0}),  # a corrected turn in a session that ended well
    (0.5, [], set()),
])
def test_the_turns_practised_are_those_judged_below_zero(reward, turn_rewards, corrected):
    trajectory = Trajectory(id="s", session_id="s", segments=[], turns=[object()] * 3, close_reason="end")
    sample = Sample(id="s", trajectory_seq=1, reward=reward, turn_rewards=turn_rewards, judge="rule")
    assert corrected_turns(sample, trajectory) == corrected


async def test_practice_replies_holding_personal_data_are_left_out_under_the_tenants_policy(nats_url, tmp_path):
    """A reply the tenant's `pii: drop` would never record is no practice either; under `off` it is."""
    asked = [{"role": "user", "content": "Where can I write to you?"}]
    taught = teach_tiny(asked, None, "Write to ada.lovelace@example.com today.")
    _, tokenizer = load_model(taught)
    prompt = chat_prompt(tokenizer, asked)
    async with platform(nats_url, tmp_path, *PRACTICE, f"model={taught}") as (serve, _, _):
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
            kept = {}
            for tenant in ("acme", "other"):  # acme: pii off; other: the default, drop
                response = await http.post("/engine/practice", json={
                    "adapter": tenant, "tenant": tenant, "input_ids": prompt, "n": 3,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": 32}})
                response.raise_for_status()
                kept[tenant] = [reply["text"] for reply in response.json()["replies"]]
    assert len(kept["acme"]) == 3 and all("ada.lovelace@example.com" in text for text in kept["acme"])
    assert kept["other"] == []


def test_the_answers_check_takes_away_the_persons_words_and_keeps_what_the_served_memory_put_before_them():
    """With `memory.placement: user` a conversation's first user message holds the person's
    instructions before their question: the untold request keeps them (a reply that only follows
    them must not count as answering), and a later user message is emptied whole."""
    first = [{"role": "system", "content": "S."}, {"role": "user", "content": "Be brief.\n\nHow do tides work?"}]
    assert without_request(first, ["Be brief."]) == [{"role": "system", "content": "S."}, {"role": "user", "content": "Be brief.\n\n"}]
    assert without_request(first)[1]["content"] == ""  # none were served
    later = [*first, {"role": "assistant", "content": "The moon."}, {"role": "user", "content": "Be brief.\n\nMore?"}]
    assert without_request(later, ["Be brief."])[1:] == [first[1], later[2], {"role": "user", "content": ""}]


@pytest.mark.parametrize("placement", ["user", "system"])
async def test_bare_practice_answers_the_request_without_the_served_instructions(placement, nats_url, tmp_path, bus):
    """`judge.teacher.practice_prompt: bare`: the person's turn was served with her instruction, but
    her adapter practises her request as she sent it (rendered again by the policy's server), with
    the engine's exact log-probs of that prompt, and the teacher, told her correction, scores that."""
    base, tokenizer = load_model("tiny")
    [(adapter, peft)] = random_adapters(tmp_path, {"ada-adapter": (1, {"r": 4, "target_modules": LINEAR})}).values()
    memory = ["memory.enabled=true", f"memory.placement={placement}", "judge.teacher.practice_prompt=bare"]
    async with platform(nats_url, tmp_path, *PRACTICE, *memory) as (serve, _, _):
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="ada-v1", version=1, path=str(adapter), step=1, adapter=ADA))
        await bus.publish(memory_subject("acme", "ada"), Instructions(
            id="ada-memory", tenant="acme", user_id="ada", instructions=[SAY_NAME], read=[], turns=[], read_from=0.0))
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1 and len(serve.memory) == 1)
        async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer root"}) as http:
            both = await http.post("/engine/practice", json={"adapter": ADA, "tenant": "acme", "input_ids": [1, 2],
                                                              "messages": [{"role": "user", "content": "Hi"}], "n": 2})
        assert both.status_code == 400 and "input_ids or as messages" in both.json()["error"]["message"]
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        try:
            messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Greet me."}]
            await hinted_session(serve, "corrected", messages, HINT, reward=-1.0)
            samples = await read(bus, SAMPLE_SUBJECT, "practice-bare", 4)
        finally:
            await judge.stop()
    [own] = [s for s in samples if s.judge != "practice"]
    await bus.resolve(own)
    assert own.trajectory.turns[0].instructions == [SAY_NAME]
    assert SAY_NAME in tokenizer.decode(own.trajectory.segments[0].token_ids)  # served with it
    context = chat_prompt(tokenizer, messages)  # practised without it
    told_ids = chat_prompt(tokenizer, Teacher(serve.config.judge.teacher, serve.url).told(messages, HINT))
    for sample in [s for s in samples if s.judge == "practice"]:
        [segment], [turn] = sample.trajectory.segments, sample.trajectory.turns
        (_, begin, end), = segment.turn_spans
        output = list(segment.token_ids[begin:end])
        assert list(segment.token_ids[:begin]) == context and (turn.messages, turn.instructions) == (messages, [])
        assert list(segment.logprobs[begin:end]) == pytest.approx(recomputed_logprobs(peft, context, output), abs=2e-4)
        [teacher] = sample.teacher_logprobs
        assert list(teacher[begin:end]) == pytest.approx(recomputed_logprobs(base, told_ids, output), abs=2e-4)


def test_a_requests_messages_as_the_person_sent_them_are_those_without_the_served_instructions():
    """`unplaced` undoes either placement: the text before the first user message's (a string, or a
    part of its own), or the template at the end of the system message (or a system message of it
    alone); a later message that happens to begin with the same words is the person's own."""
    said = [SAY_NAME]
    asked = [{"role": "system", "content": "S."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": placed_before(said) + "More"}]
    in_user = [asked[0], {"role": "user", "content": placed_before(said) + "Hi"}, *asked[2:]]
    as_part = [asked[0], {"role": "user", "content": [{"type": "text", "text": placed_before(said)},
                                                      {"type": "text", "text": "Hi"}]}, *asked[2:]]
    in_system = [{"role": "system", "content": "S." + TEMPLATE.replace("$instructions", SAY_NAME)}, *asked[1:]]
    alone = [{"role": "system", "content": TEMPLATE.replace("$instructions", SAY_NAME).strip()}, *asked[1:]]
    assert unplaced(in_user, said, TEMPLATE) == asked and unplaced(in_system, said, TEMPLATE) == asked
    assert unplaced(as_part, said, TEMPLATE)[1] == {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    assert unplaced(alone, said, TEMPLATE) == asked[1:]
    assert unplaced(asked, [], TEMPLATE) == asked and unplaced(asked, said, TEMPLATE) == asked
