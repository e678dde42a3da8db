"""What the personal-agent benchmarks share: pacing a simulated person to the platform (the next
session once the last one is trained and its version serves) and the held-out satisfaction of a
policy's replies (bench/personal_agent.py, bench/two_people.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from statistics import fmean

from flywheel.drills.personal_agent import CONFIG, Asked, all_taken, opening_of, prompt_ids
from flywheel.drills.simulated_people import User, answers


def wait_trained(deployment, sessions: int, timeout_s: float) -> dict:
    """Until the judge has scored `sessions` sessions, the gateway has taken every person's
    instructions it published (`memory.enabled`), the trainer has taken (trained or dropped)
    every sample the judge published, a session's own and its practice samples, and serve answers
    with the version that came of it (or the timeout: the next session starts anyway, with
    whatever is served). The deployment's stats at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = deployment.stats()
        judge, train, serve = stats.get("judge", {}), stats.get("train"), stats.get("serve", {})
        judged = judge.get("scored", 0) + judge.get("unscored", 0)
        done = judged >= sessions and (serve.get("instructions_taken") or 0) >= (judge.get("instructions_published") or 0)
        if done and train is not None:
            trained = train.get("adapters")
            served = (all(serve.get("adapters", {}).get(name, 0) >= v for name, v in trained.items()) if trained
                      else serve.get("version", -1) >= train.get("version", 0))  # with adapters: each adapter's version
            done = all_taken(judge, train) and served
        if done or time.monotonic() > deadline:
            return {**stats, "waited_out": not done}
        time.sleep(0.2)


async def satisfaction(weights: Path | None, model_name: str, user: User, questions: tuple[str, ...] | list[str], args,
                       hint: str | list[str] | None = None, others: tuple[User, ...] = (), asked: Asked | None = None) -> dict:
    """How often replies to `questions` satisfy the user (`--heldout-samples` seeded samples each,
    the app's temperature and max_tokens, the same seeds for every arm), and how often the same
    replies would satisfy each of `others` (`others`: their preference's kind -> rate). With a
    `hint`: the teacher's view, each request told the hint exactly as the hint teacher renders it;
    `asked`: how the questions are put (the memory baseline's system message, the served memory's
    instructions; default: the user's system message alone)."""
    from flywheel.models import load_model, load_weights

    model, tokenizer = load_model(model_name)
    if weights is not None:
        load_weights(model, weights)
    questions = [q for q in questions for _ in range(args.heldout_samples)]
    chats = [(asked or Asked(user.system)).chat(q) for q in questions]
    if hint is not None:
        chats = [told(chat, hint, args) for chat in chats]
    replies = [opening_of(chat) + tokenizer.decode(ids, skip_special_tokens=True)
               for chat, ids in zip(chats, await sample(model, tokenizer, chats, args))]
    return {"rate": fmean(user.satisfied(r, q) for r, q in zip(replies, questions)),
            "others": {o.preference.kind: fmean(o.satisfied(r, q) for r, q in zip(replies, questions)) for o in others},
            "answers": fmean(answers(q, r) for r, q in zip(replies, questions)), "n": len(replies), "examples": replies[:3]}


def told(chat: list[dict], hint: str | list[str], args) -> list[dict]:
    """`chat` told `hint` (a person's corrections, read together, as the teacher's memory tells
    them) exactly as the hint teacher renders it (the bench's configuration, `judge.teacher.wishes`
    included)."""
    from flywheel.config import load_config
    from flywheel.judge import teacher, wishes

    config = load_config(CONFIG, args.overrides).judge.teacher
    return teacher.told(chat, wishes.Wish([hint] if isinstance(hint, str) else hint, config.wishes).told, config)


def log_prob(model, tokenizer, chat: list[dict], reply: list[int]) -> float:
    """log p(reply | chat) under `model` (a prefill, as the teacher's server scores)."""
    import torch

    ids = prompt_ids(tokenizer, chat)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + reply])).logits[0, len(ids) - 1:-1].float()
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(reply)[:, None]).sum())


def information(scorer, tokenizer, chat: list[dict], instructions: list[str], replies: list[list[int]]) -> list[float]:
    """How much likelier the request in `chat` makes each reply, in nats, under `scorer` (the frozen
    base, as the gateway reads it, flywheel/serve/best_of.py): the request emptied of the person's
    words and `instructions` (as placed) kept."""
    from flywheel.bus.instructions import without_request

    untold = without_request(chat, instructions)
    return [log_prob(scorer, tokenizer, chat, r) - log_prob(scorer, tokenizer, untold, r) for r in replies]


def served(aspects: list[str], texts: list[str], gains: list[float], chat: list[dict]) -> int:
    """The index of the reply the gateway serves (`wish_checks.best`; the first where none answers)."""
    from flywheel.formats.wish_checks import best

    picked = best(aspects, texts, chat, gains)
    return 0 if picked is None else picked


async def sample(model, tokenizer, chats: list[list[dict]], args, first_seed: int = 0) -> list[list[int]]:
    """One reply's tokens to each chat, all in one batch of the embedded engine (`args.max_tokens`,
    `args.temperature`; request i seeded `first_seed` + i)."""
    from flywheel.serve.engine import Engine, SamplingParams

    prompts = [prompt_ids(tokenizer, chat) for chat in chats]
    engine = Engine(model, tokenizer, max_batch_size=len(prompts)).start()
    try:
        results = await asyncio.gather(*(engine.generate(p, SamplingParams(
            max_new_tokens=args.max_tokens, temperature=args.temperature, sampling_seed=first_seed + i))
            for i, p in enumerate(prompts)))
    finally:
        engine.stop()
    return [list(r.output_ids) for r in results]
