"""Serving the best of k replies by the checks of the person's wish (`memory.best_of`,
flywheel/serve/best_of.py): a reply that does not answer is never preferred for its form; the
gateway draws k, serves and records only the one the checks rank first; nothing else is drawn
more than once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx
import pytest

from flywheel.bus.instructions import Instructions
from flywheel.bus.records import Turn
from flywheel.bus.streams import TRAFFIC_SUBJECTS, memory_subject
from flywheel.config import load_config
from flywheel.formats.wish_checks import best
from flywheel.judge.wishes import ASPECTS
from flywheel.models import load_model
from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.sessions import session_of
from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.in_process import InProcessEngineClient
from flywheel.serve.best_of import BestOf, Reply, best_of
from flywheel.serve.continuation import SessionContinuations
from flywheel.serve.engine import Engine
from flywheel.serve.ops.tenants import OPEN, Grant
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.scoring_server import input_logprobs, output_logprobs

from bus_reading import read
from factories import platform
from waiting import until

SHORTER = ASPECTS["shorter"]
FORMAL = ASPECTS["formal"]
SEED = 7
QUESTION = "What is the capital of France?"
REPLIES = ["Sure, I'd be happy to help!", "The capital of France is Paris, a city on the Seine.",
           "Paris is the capital of France, and it is also its largest city, with many famous museums and monuments.",
           "I like turtles."]
"""Two that do not answer (the shorter two), two that do."""


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model("smollm2-135m")
    engine = Engine(model, tokenizer, max_batch_size=8).start()
    yield InProcessEngineClient(engine), tokenizer
    engine.stop()


def ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)


async def test_the_reply_served_does_most_of_the_wish_among_those_that_answer_the_question(smollm2):
    """SmolLM2-135M reads which replies answer (the request makes them likelier); of those, the
    checks pick the one that says the most per character for `shorter` and the longest for
    `longer`; a short reply that says nothing of the question, or only names its topic, or one the
    engine cut off, is never served for being short."""
    engine, tokenizer = smollm2
    told = [{"role": "user", "content": f"{SHORTER}\n\n{QUESTION}"}]
    choosing = BestOf(4, ["shorter"], told, ids(tokenizer, told), ids(tokenizer, [{"role": "user", "content": f"{SHORTER}\n\n"}]))
    replies = [Reply(text, tokenizer.encode(text, add_special_tokens=False), whole=True) for text in REPLIES]
    assert await choosing.pick(engine, replies) == 1
    assert await replace(choosing, aspects=["longer"]).pick(engine, replies) == 2
    assert await choosing.pick(engine, [replies[0], replies[3]]) is None  # neither answers: as sampled
    topical = [Reply(text, tokenizer.encode(text, add_special_tokens=False), whole=True)
               for text in ("Ah, France!", "The capital of France is Paris.", "A question about France.")]
    assert await choosing.pick(engine, topical) == 1  # the shortest only names the topic: the most said per character
    cut = [replies[0], replace(replies[1], whole=False), replies[2]]
    assert await choosing.pick(engine, cut) == 2
    draw = {"input_ids": ids(tokenizer, told), "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
            "return_logprob": True}
    broken = {**draw, "input_ids": [10**9]}  # one draw the engine refuses: the others are served
    j, response, _ = await choosing.served(engine, [broken, {**draw, "rid": "d1"}, {**draw, "rid": "d2"}])
    assert j in (1, 2) and response["output_ids"]
    with pytest.raises(EngineError):
        await choosing.served(engine, [broken, {**broken, "rid": "b2"}])


async def test_a_reply_about_the_instruction_is_not_served_for_its_form(smollm2):
    """Told how to write, a small model often writes about the instruction: the request makes such a
    reply a little likelier (SmolLM2-135M: about 4 nats), but it says under half what an answer
    says (about 11): not served, however well it keeps the form (no exclamation mark here)."""
    engine, tokenizer = smollm2
    told = [{"role": "user", "content": f"{FORMAL}\n\n{QUESTION}"}]
    choosing = BestOf(2, ["formal"], told, ids(tokenizer, told), ids(tokenizer, [{"role": "user", "content": f"{FORMAL}\n\n"}]))
    replies = [Reply(text, tokenizer.encode(text, add_special_tokens=False), whole=True)
               for text in ("I shall write in formal English, without contractions, regarding France.",
                            "The capital of France is Paris!")]
    assert await choosing.pick(engine, replies) == 1


def test_only_a_whole_plain_chat_answer_with_instructions_served_is_drawn_more_than_once(model_and_tokenizer):
    """Streams, several choices, greedy sampling, tools, a response format and a request the served
    memory put nothing in are served one reply; a wish no rule checks (or two opposite ones) is
    drawn too, the first that answers served; the untold prompt keeps the instruction, not
    the question; vLLM's engine client, which cannot score, is refused by the configuration."""
    _, tokenizer = model_and_tokenizer
    prompts = PromptBuilder(tokenizer, SessionContinuations(tokenizer, 10))
    asking = session_of({"x-user-id": "ada"}, None, None, grant=Grant("open", OPEN.training, True))

    def choice(aspects: tuple[str, ...], k: int = 2, forced: str = "", tools: bool = False,
               instructions: tuple[str, ...] = (SHORTER,), **asked) -> BestOf | None:
        body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": f"{SHORTER}\n\nTides?"}], **asked)
        session = replace(asking, instructions=instructions, aspects=aspects)
        return asyncio.run(best_of(k, body, session, prompts, "tiny", forced, tools))

    drawn = choice(("shorter",), k=3)
    assert drawn is not None and drawn.k == 3 and drawn.aspects == ["shorter"]
    untold = tokenizer.decode(drawn.untold_ids)
    assert SHORTER in untold and "Tides?" not in untold and drawn.messages[0]["content"].endswith("Tides?")
    assert choice(("shorter", "formal")) is not None
    for unchecked in [("example",), ("shorter", "longer")]:
        assert choice(unchecked).aspects == list(unchecked)
    for refused in [choice(("shorter",), k=1), choice(("shorter",), stream=True), choice(("shorter",), n=2),
                    choice(("shorter",), tools=True, forced="<tool_call>"),
                    choice(("shorter",), response_format={"type": "json_object"}),
                    choice(("shorter",), temperature=0.0), choice((), instructions=())]:
        assert refused is None
    with pytest.raises(ValueError, match="memory.best_of"):
        load_config(None, ["memory.best_of=2", "serve.engine_kind=vllm"])


async def test_the_gateway_serves_and_records_the_first_ranked_of_k_draws_alone(nats_url, tmp_path, bus):
    """Through the platform (`memory.best_of=3`): Ada's whole answer is the draw the checks of
    her wish rank first among the three the same request with n=3 samples (seed + 0, 1, 2), the
    only turn recorded for it (`best_of` 3, its own draw's seed); her stream is one draw."""
    async with platform(nats_url, tmp_path, "memory.enabled=true", "memory.placement=user", "memory.best_of=3") as (
            serve, _, client):
        await bus.publish(memory_subject("open", "ada"), Instructions(
            id="m", tenant="open", user_id="ada", instructions=[SHORTER], aspects=["shorter"], read=["shorter"],
            turns=["t"], read_from=1.0, created_at=time.time()))
        ada = session_of({"x-user-id": "ada"}, None, None, grant=Grant("open", OPEN.training, True))
        await until(lambda: serve.memory.instructions(ada).aspects == ("shorter",))
        asked = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about tides."}], max_tokens=12,
                     temperature=1.0, seed=SEED)
        raw = await client.chat.completions.with_raw_response.create(
            **asked, extra_headers={"X-Session-Id": "ada-1", "X-User-Id": "ada"})
        await client.chat.completions.create(**asked, n=3, extra_headers={"X-Session-Id": "ada-n", "X-User-Id": "ada"})
        async for _ in await client.chat.completions.create(
                **asked, stream=True, extra_headers={"X-Session-Id": "ada-s", "X-User-Id": "ada"}):
            pass
        turns = {t.session_id: t for t in await read(bus, TRAFFIC_SUBJECTS, "best-of", 5, lambda r: isinstance(r, Turn))}
        served, draws = turns["ada-1"], [turns[f"ada-n/{j}"] for j in range(3)]
        tokenizer = serve.engine.tokenizer
        untold = ids(tokenizer, [{"role": "user", "content": f"{SHORTER}\n\n"}])
        engine = serve.pool.engines[0]

        async def likelihood(prompt: list[int], output: list[int]) -> float:
            return sum(output_logprobs(await input_logprobs(engine, list(prompt), list(output))))
        gains = [await likelihood(served.prompt_ids, d.output_ids) - await likelihood(untold, d.output_ids) for d in draws]
        async with httpx.AsyncClient() as http:
            scraped = (await http.get(f"{serve.url}/metrics")).text
    texts = [d.response["content"] for d in draws]
    first = best(["shorter"], texts, served.messages, gains)
    assert first != 0 and all(d.prompt_ids == served.prompt_ids for d in draws)  # a choice the first draw alone would miss
    assert served.output_ids == draws[first].output_ids and served.output_logprobs == draws[first].output_logprobs
    assert served.best_of == 3 and served.sampling["sampling_seed"] == SEED + first
    assert served.id == raw.headers["x-interaction-id"] and raw.parse().choices[0].message.content == texts[first]
    assert turns["ada-s"].best_of == 1 and {d.best_of for d in draws} == {1}
    assert len(turns) == 5  # nothing recorded of the draws not served
    assert 'flywheel_best_of_answers_total{outcome="chosen"} 1.0' in scraped and 'outcome="as_sampled"' not in scraped
