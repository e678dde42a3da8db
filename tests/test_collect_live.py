"""Collect through the real serve loop: multi-turn chats sent with the official openai client
become trajectories holding exactly the ids the engine saw and sampled, with the loss mask 1
exactly on sampled tokens: the `tiny` ChatML template, SmolLM2's, parallel tool calls and their
results, a template that rewrites history (a split), and many interleaved sessions."""

import asyncio

import pytest

from flywheel.bus import TRAFFIC_SUBJECTS, SessionEvent, Turn
from flywheel.models.tiny import CHAT_TEMPLATE

from bus_reading import collected
from factories import (
    assert_prompts_render_the_conversation,
    assert_segment_is_exact,
    platform,
    post_feedback,
    teach_tiny,
)
from waiting import until

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK_TWO = [{"role": "user", "content": "Weather in Paris and in Rome?"}]
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
# Like reasoning models' templates: the generation prompt opens a <think> block that the
# rendering of earlier assistant turns leaves out, so no turn's prompt extends the last one.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace("{{- '<|im_start|>assistant\n' }}", "{{- '<|im_start|>assistant\n<think>\n' }}")
assert THINKING_TEMPLATE != CHAT_TEMPLATE


async def conversation(serve, client, session: str, user_texts: list[str], reward: float = 1.0, **kw) -> list[dict]:
    """Chat turn by turn as an agent does (the whole history each time), then send a reward."""
    messages: list[dict] = []
    for i, text in enumerate(user_texts):
        messages.append({"role": "user", "content": text})
        reply = await client.chat.completions.create(
            model=serve.model_name, messages=messages, max_tokens=8, seed=i, extra_headers={"X-Session-Id": session}, **kw
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    await post_feedback(serve, session, reward)
    return messages


async def test_a_tiny_chatml_conversation_is_one_exact_segment(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path) as (serve, _, client):
        await conversation(serve, client, "chat-1", ["Count to three.", "Now backwards.", "Thanks!"])
        trajectories, turns = await collected(bus, 1, 3)
    traj, session_turns = trajectories["chat-1"], turns["chat-1"]
    assert [t.turn_index for t in traj.turns] == [0, 1, 2] and traj.close_reason == "feedback"
    [segment] = traj.segments
    assert_segment_is_exact(segment, session_turns)
    assert_prompts_render_the_conversation(serve.engine.tokenizer, session_turns)
    assert traj.next_states == [[{"role": "user", "content": "Now backwards."}], [{"role": "user", "content": "Thanks!"}], []]


async def test_smollm2_template_conversation_is_one_exact_segment(nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, "model=smollm2-135m") as (serve, _, client):
        await conversation(serve, client, "smol", ["What is 2 + 2?", "And 3 + 3?"])
        trajectories, turns = await collected(bus, 1, 2)
    [segment] = trajectories["smol"].segments
    assert_segment_is_exact(segment, turns["smol"])
    assert_prompts_render_the_conversation(serve.engine.tokenizer, turns["smol"])
    assert "SmolLM" in serve.engine.tokenizer.decode(segment.token_ids)  # SmolLM2's default system prompt


@pytest.fixture(scope="module")
def two_call_model():
    return teach_tiny(ASK_TWO, [WEATHER], TWO_CALLS)


async def test_parallel_tool_calls_and_their_results_stay_in_one_segment(two_call_model, nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, f"model={two_call_model}") as (serve, _, client):
        head = {"X-Session-Id": "tools"}
        reply = await client.chat.completions.create(
            model=serve.model_name, messages=ASK_TWO, tools=[WEATHER], temperature=0, max_tokens=60, extra_headers=head
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = reply.choices[0].message.tool_calls
        assert [c.function.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
        results = [{"role": "tool", "tool_call_id": c.id, "content": f"sunny in call {i}"} for i, c in enumerate(calls)]
        history = ASK_TWO + [reply.choices[0].message.model_dump(exclude_none=True)] + results
        await client.chat.completions.create(model=serve.model_name, messages=history, tools=[WEATHER], max_tokens=5,
                                             extra_headers=head)
        await post_feedback(serve, "tools", 1.0)
        trajectories, turns = await collected(bus, 1, 2)
    traj = trajectories["tools"]
    [segment] = traj.segments
    assert_segment_is_exact(segment, turns["tools"])
    assert_prompts_render_the_conversation(serve.engine.tokenizer, turns["tools"], tools=[WEATHER])
    assert traj.next_states[0] == results  # both tool results, together, are what followed the calls


async def test_parallel_tool_calls_false_ends_the_answer_after_one_call(two_call_model, nats_url, tmp_path, bus):
    async with platform(nats_url, tmp_path, f"model={two_call_model}") as (serve, _, client):
        reply = await client.chat.completions.create(
            model=serve.model_name, messages=ASK_TWO, tools=[WEATHER], temperature=0, max_tokens=60,
            parallel_tool_calls=False, extra_headers={"X-Session-Id": "one-call"},
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        assert [c.function.arguments for c in reply.choices[0].message.tool_calls] == ['{"city": "Paris"}']
        await post_feedback(serve, "one-call", 1.0)
        _, turns = await collected(bus, 1, 1)
    [turn] = turns["one-call"]
    decode = serve.engine.tokenizer.decode
    assert "</tool_call>" in decode(turn.output_ids) and "</tool_call>" not in decode(turn.output_ids[:-1])  # ends there
    assert turn.sampling["stop"] == ["</tool_call>"]


async def test_a_conversation_with_stop_strings_stays_one_segment(nats_url, tmp_path, bus):
    """The client gets the text before the stop string; the recorded output runs to the token
    that completed it (the model's action); the next turn continues those exact ids."""
    stops = [" ", "e", "a", "o"]
    async with platform(nats_url, tmp_path) as (serve, _, client):
        messages: list[dict] = []
        for i, text in enumerate(["Say something.", "And now?", "Go on."]):
            messages.append({"role": "user", "content": text})
            reply = await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=16, seed=i,
                                                         stop=stops, extra_headers={"X-Session-Id": "stops"})
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        await post_feedback(serve, "stops", 1.0)
        trajectories, turns = await collected(bus, 1, 3)
    tokenizer = serve.engine.tokenizer
    for turn in turns["stops"]:  # each answer was cut by a stop string (the seeds make sure of it)
        output = tokenizer.decode(turn.output_ids)
        assert turn.finish_reason == "stop" and any(s in output for s in stops)
        assert not any(s in turn.response["content"] for s in stops) and output.startswith(turn.response["content"])
        assert not any(s in tokenizer.decode(turn.output_ids[:-1]) for s in stops)  # it ends at the completing token
    [segment] = trajectories["stops"].segments
    assert_segment_is_exact(segment, turns["stops"])


async def test_special_tokens_the_client_never_saw_stay_in_one_segment(nats_url, tmp_path, bus):
    """The model may sample a special token mid-answer (`<|endoftext|>`, `<|im_start|>`) or end
    on one other than the template's end token; the client's text skips it, the recorded output
    keeps it, and the next turn continues those exact ids (the untrained model samples
    `<|im_start|>` as the 13th token with seed 15, and as the 9th with seed 17: cut there, the
    answer ends on it)."""
    seeds = {"mid": (15, 16), "ends-on-other": (17, 9)}
    async with platform(nats_url, tmp_path) as (serve, _, client):
        for session, (seed, max_tokens) in seeds.items():
            messages = [{"role": "user", "content": "Hi."}]
            for i in range(2):
                reply = await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=max_tokens,
                                                             seed=seed, extra_headers={"X-Session-Id": session})
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            await post_feedback(serve, session, 1.0)
        trajectories, turns = await collected(bus, 2, 4)
    tokenizer = serve.engine.tokenizer
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    first_mid, first_end = turns["mid"][0].output_ids, turns["ends-on-other"][0].output_ids
    assert special & set(first_mid[:-1]), "the seed no longer samples a special token mid-answer"
    assert first_end[-1] in special and first_end[-1] != tokenizer.eos_token_id
    for session in seeds:
        [segment] = trajectories[session].segments
        assert_segment_is_exact(segment, turns[session])


async def test_each_request_is_announced_with_its_turn_ids_before_its_turns(nats_url, tmp_path, bus):
    """The collector keeps a session open while a reply is being generated (a reply slower than
    collect.idle_timeout_s does not split it; tests/test_collect.py has the clock): the gateway
    announces each session request's turns on TRAFFIC before it records them, whole or streamed,
    n > 1 included, and announces nothing for a request without a session."""
    async with platform(nats_url, tmp_path) as (serve, _, client):
        messages = [{"role": "user", "content": "Hi."}]
        whole = await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=4, n=2,
                                                     extra_headers={"X-Session-Id": "announced"})
        stream = await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=4, stream=True,
                                                      extra_headers={"X-Session-Id": "announced"})
        [chunk.id async for chunk in stream]
        await client.chat.completions.create(model=serve.model_name, messages=messages, max_tokens=4)
        consumer = bus.consumer(TRAFFIC_SUBJECTS, "announcements")
        records: list = []

        async def four_turns_read() -> bool:
            records.extend(d.record for d in await consumer.fetch(timeout_s=1))
            return sum(isinstance(r, Turn) for r in records) >= 4

        await until(four_turns_read)
    announced = [r for r in records if isinstance(r, SessionEvent) and r.kind == "pending"]
    turns = [r for r in records if isinstance(r, Turn)]
    rid = whole.id.removeprefix("chatcmpl-")
    assert [(e.session_id, e.turn_ids) for e in announced[:2]] == [("announced/0", [f"{rid}-0"]), ("announced/1", [f"{rid}-1"])]
    assert len(announced) == 3 and announced[2].session_id == "announced"  # the stream's; none for the anonymous request
    for event in announced:
        [turn] = [t for t in turns if t.id == event.turn_ids[0]]
        assert turn.session_id == event.session_id and records.index(event) < records.index(turn)


async def test_a_template_that_rewrites_history_splits_the_session(nats_url, tmp_path, bus):
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    async with platform(nats_url, tmp_path, f"serve.chat_template={template}") as (serve, collect, client):
        await conversation(serve, client, "think", ["First question?", "Second question?"])
        trajectories, turns = await collected(bus, 1, 2)
        assert collect.stats()["splits"] == 1
    first, second = turns["think"]
    assert serve.engine.tokenizer.decode(first.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")
    segments = trajectories["think"].segments
    assert len(segments) == 2
    assert_segment_is_exact(segments[0], [first])
    assert_segment_is_exact(segments[1], [second])


async def test_many_interleaved_sessions_each_get_their_exact_trajectory(nats_url, tmp_path, bus):
    sessions = [f"many-{i}" for i in range(12)]
    async with platform(nats_url, tmp_path) as (serve, _, client):
        await asyncio.gather(*(conversation(serve, client, s, ["Hello.", "More.", "Done."], reward=i)
                               for i, s in enumerate(sessions)))
        trajectories, turns = await collected(bus, len(sessions), 3 * len(sessions))
    assert sorted(trajectories) == sorted(sessions)
    for i, session in enumerate(sessions):
        traj = trajectories[session]
        assert traj.feedback[0].reward == i and [t.session_id for t in traj.turns] == [session] * 3
        [segment] = traj.segments
        assert_segment_is_exact(segment, turns[session])
