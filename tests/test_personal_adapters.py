"""Every user learns their own agent, end to end: with `adapters.kind: lora` a user's rewarded
conversation trains that user's adapter (the base and the other user's adapter untouched), the
trainer publishes it alone, every gateway loads it, and the user's next turn is sampled by it
(its version, its log-probs), while the other user is served by their own and the shared
weights never change version."""

import openai
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from flywheel.bus import SAMPLE_SUBJECT, WEIGHTS_SUBJECT, WeightUpdate
from flywheel.config import load_config
from flywheel.deploy.deployment import needs_judge_server
from flywheel.judge.loop import JudgeLoop
from flywheel.judge.teacher import Teacher
from flywheel.models import load_model
from flywheel.models.adapter_names import user_adapter
from flywheel.models.lora_adapter import read_adapter

from bus_reading import read, recorded_turns
from factories import chat_prompt, platform, recomputed_logprobs
from peft_adapters import LINEAR, random_adapters
from tenant_traffic import TENANTS_SETUP, converse, hinted_session, learning
from waiting import until

LORA = [*TENANTS_SETUP, "adapters.kind=lora", "adapters.scope=user", "actor.optimizer.lr=0.05",
        "adapters.guard_drop=null"]  # the guard is test_adapter_guard.py's: tiny at this rate can pass its default bound
ADA, BOB = user_adapter("acme", "ada"), user_adapter("acme", "bob")


async def ask(serve, user: str, session: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello again."}],
                                         max_tokens=4, extra_headers={"X-Session-Id": session, "X-User-Id": user})


async def test_a_users_rewarded_turn_trains_their_adapter_which_then_serves_them(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, *LORA) as (serve, _, _):
        async with learning(serve, nats_url) as train:
            # Each adapter's first reward sets its own baseline: no advantage, no change. Bob's -1
            # says nothing of what Ada's +1 means (with one baseline for all, hers would be +2).
            steps = {ADA: 0, BOB: 0}
            for number, (user, reward) in enumerate([("bob", -1.0), ("ada", 1.0), ("ada", -1.0)], 1):
                await converse(serve, user, f"{user}-{number}", reward=reward)
                adapter = ADA if user == "ada" else BOB
                steps[adapter] += 1
                await until(lambda: serve.pool.adapter_versions.get(adapter) == steps[adapter])  # published, loaded
            assert train.trainer.step_count == 3
            published = tmp_path / "adapters" / ADA / "v2"
            await ask(serve, "ada", "ada-again")
            await ask(serve, "bob", "bob-again")
        turns = {t.session_id.split("/", 1)[1]: t for t in await recorded_turns(bus, 5)}

    assert turns["ada-2"].adapter == ADA and set(turns["ada-2"].output_versions) == {0}  # her adapter, still the base
    assert turns["ada-3"].adapter == ADA and set(turns["ada-3"].output_versions) == {1}
    assert turns["ada-again"].adapter == ADA and set(turns["ada-again"].output_versions) == {2}  # trained on her -1
    assert turns["bob-again"].adapter == BOB and set(turns["bob-again"].output_versions) == {1}  # his own, apart
    first = load_file(tmp_path / "adapters" / ADA / "v1" / "adapter_model.safetensors")
    assert all(not t.any() for key, t in first.items() if "lora_B" in key)  # her first advantage was 0
    assert serve.pool.weight_version == 0 and not (tmp_path / "weights").exists()  # the shared weights never moved

    # What sampled ada's second turn is her adapter: the engine's log-probs are PEFT's with it.
    assert read_adapter(published).rank == serve.config.adapters.rank
    base, _ = load_model("tiny")
    peft = PeftModel.from_pretrained(base, str(published)).eval()
    turn = turns["ada-again"]
    ids = torch.tensor([turn.prompt_ids + turn.output_ids])
    with torch.no_grad():
        logits = peft(ids).logits[0, len(turn.prompt_ids) - 1:-1].float()
    recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(turn.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(recomputed, torch.tensor(turn.output_logprobs), atol=2e-4, rtol=0)
    with peft.disable_adapter(), torch.no_grad():
        bare = torch.log_softmax(peft(ids).logits[0, len(turn.prompt_ids) - 1:-1].float(), -1)
    assert (bare.gather(1, torch.tensor(turn.output_ids)[:, None])[:, 0] - recomputed).abs().max() > 1e-3


async def test_the_bare_base_on_the_policys_server_is_the_teacher(nats_url, tmp_path, bus):
    """With adapters no judge server is needed for the teacher: the base on the policy's own server
    (a scoring request names no adapter) is the frozen starting model. A turn Ada's adapter sampled,
    hinted, gets the base's log-probs of its tokens under the hinted request, not her adapter's."""
    config = [*LORA, "judge.teacher.enabled=true"]
    assert not needs_judge_server(load_config(None, config)) and needs_judge_server(load_config(None, TENANTS_SETUP[:-1] + [
        "judge.kind=rule", "judge.teacher.enabled=true"]))
    base, tokenizer = load_model("tiny")
    [(adapter, peft)] = random_adapters(tmp_path, {"ada-adapter": (1, {"r": 4, "target_modules": LINEAR})}).values()
    async with platform(nats_url, tmp_path, *config) as (serve, _, _):
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="ada-v1", version=1, path=str(adapter), step=1, adapter=ADA))
        await until(lambda: serve.pool.adapter_versions.get(ADA) == 1)
        judge = JudgeLoop(serve.config, nats_url)
        await judge.start()
        try:
            messages, hint = [{"role": "user", "content": "Greet me."}], "Say my name, Ada, first."
            await hinted_session(serve, "hinted", messages, hint, reward=1.0)
            [sample] = await read(bus, SAMPLE_SUBJECT, "hint-check")
            assert await bus.resolve(sample)
        finally:
            await judge.stop()
    [turn], [teacher] = sample.trajectory.turns, sample.teacher_logprobs
    (_, start, end), = sample.trajectory.segments[0].turn_spans
    assert turn.adapter == ADA and set(sample.trajectory.segments[0].versions[start:end]) == {1}
    prompt_ids = chat_prompt(tokenizer, Teacher(serve.config.judge.teacher, serve.url).told(messages, hint))
    output = list(sample.trajectory.segments[0].token_ids[start:end])
    expected = recomputed_logprobs(base, prompt_ids, output)
    assert list(teacher[start:end]) == pytest.approx(expected, abs=2e-4)
    assert max(abs(a - b) for a, b in zip(expected, recomputed_logprobs(peft, prompt_ids, output))) > 1e-3
