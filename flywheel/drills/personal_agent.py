"""The personal-agent drill (OpenClaw-RL's personal-agent experiment): a simulated person
(`simulated_people.User`) talks to a deployed agent with the official `openai` client, one
`X-Session-Id` per conversation and nothing else, and the numbers that say whether the agent
learned their hidden preference.

- `converse`: one session: the question, the first reply, the person's reaction and the reply to
  it (with two reactions, also the reaction to that second reply and a third reply);
- `verdicts`: what the judge made of each session's reactions, and how many tokens the hint
  teacher scored, read back from the bus's samples;
- `sessions_to_learn`, `rolling_rate`, `judge_agreement`, `summary_rows`: the measures.

`ARMS` are the configurations compared (on `CONFIG`): the base model, next-state RL, hint
distillation, both, and OpenClaw-RL's memory baseline (nothing trains; the app keeps the hints
the judge's reader finds in the person's reactions and puts them in the system message:
`with_memory`), and the platform's own memory of that kind (`served`: `memory.enabled`, the
instructions the judge reads in the person's corrections put in their prompts by the gateway:
flywheel/serve/served_memory.py). `bench/personal_agent.py` runs trials of them; tests/test_personal_agent.py
runs one small session pair on live loops.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from statistics import fmean

from flywheel.config.memory import MemoryConfig
from flywheel.drills.simulated_people import User

CONFIG = "configs/personal_agent.yaml"
ARMS = {
    "none": ["deploy.loops=[serve,collect,judge]", "judge.teacher.enabled=false"],
    "rl": ["actor.rl_coef=1.0", "actor.opd_coef=0.0", "actor.opd_topk_coef=0.0", "judge.teacher.enabled=false"],
    "opd": ["actor.rl_coef=0.0"],
    "both": ["actor.rl_coef=1.0"],
    "memory": ["deploy.loops=[serve,collect,judge]", "judge.teacher.enabled=false"],
    "served": ["deploy.loops=[serve,collect,judge]", "judge.teacher.enabled=false", "memory.enabled=true"],
}
"""Each arm's overrides; hint distillation's form and weights (`actor.opd_coef`, `opd_topk_coef`,
`judge.teacher.top_k`) are the config's."""
MEMORY = 5
"""Hints the memory baseline keeps (the newest)."""
RUN = 3
"""Consecutive satisfied sessions that count as learned."""
WINDOW = 5
"""Sessions in the plotted preference rate."""


def version_of(fingerprint: str | None) -> int | None:
    """The version a reply's `system_fingerprint` names (`flywheel-vN`); None for any other."""
    match = re.fullmatch(r"flywheel-v(\d+)", fingerprint or "")
    return int(match[1]) if match else None


def rolling_rate(satisfied: list[bool], window: int = WINDOW) -> list[float]:
    """At each session, the share of satisfied sessions among the last `window` (fewer at the start)."""
    return [fmean(satisfied[max(0, i + 1 - window):i + 1]) for i in range(len(satisfied))]


def all_taken(judge: dict, train: dict) -> bool:
    """Whether the trainer has taken (trained or dropped) every sample the judge published: each
    session's own and, with practice, its practice samples (`judge`, `train`: the loops' stats)."""
    taken = sum(train.get(k, 0) for k in ("samples", "stale_dropped", "abandoned_dropped", "unresolved"))
    return taken >= judge.get("scored", 0) + (judge.get("practice") or {}).get("samples", 0)


def judge_agreement(sessions: list[dict]) -> float | None:
    """Share of judged sessions where the judge's sign of the first reply is the truth (+1 when it
    satisfied the preference, -1 when the person corrected it)."""
    judged = [s for s in sessions if s.get("judge_score") is not None]
    return fmean((s["judge_score"] > 0) == s["satisfied"] for s in judged) if judged else None


def sessions_to_learn(satisfied: list[bool], run: int = RUN) -> int | None:
    """OpenClaw-RL's measure: the number of sessions up to and including the `run`-th of the first
    `run` consecutive sessions whose first reply satisfied the preference; None if it never happened."""
    streak = 0
    for i, ok in enumerate(satisfied):
        streak = streak + 1 if ok else 0
        if streak == run:
            return i + 1
    return None


async def served_instructions(bus_url: str, user_id: str | None = None) -> list[str]:
    """The instructions the deployment serves `user_id` now (None: the person who names none;
    `memory.enabled`: their newest record on MEMORY)."""
    from flywheel.bus import Bus
    from flywheel.bus.scan import take_all
    from flywheel.bus.streams import MEMORY

    newest = {}
    bus = await Bus.connect(bus_url, name="personal-agent-drill")
    try:
        await take_all(bus, MEMORY.name, lambda record: newest.__setitem__(record.user_id or None, record))
    finally:
        await bus.close()
    return list(newest[user_id or None].instructions) if (user_id or None) in newest else []


@dataclass(frozen=True)
class Asked:
    """How a person's questions reach the model: their system message, and the instructions the
    gateway's served memory adds where `memory.placement` puts them (none: the message alone)."""

    system: str
    instructions: tuple[str, ...] = ()
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def chat(self, question: str) -> list[dict]:
        """The chat `question` is asked in, as the gateway serves it: with `memory.opening` where
        the instructions greet the person, ending with the assistant message the gateway opens the
        reply with (`opening_of`)."""
        from flywheel.serve.api.chat import Message
        from flywheel.serve.served_memory import placed

        messages = [Message(role="system", content=self.system), Message(role="user", content=question)]
        served = self.served(question)
        if served.instructions:
            messages = placed(messages, self.memory.template, self.memory.placement, served.instructions)
        opening = [{"role": "assistant", "content": served.opening}] if served.opening else []
        return [m.for_template() for m in messages] + opening

    def served(self, question: str):
        """What the gateway serves with `question` (`served_memory.Served`): the instructions it
        places, greeting the person by the name their system message or `question` gives, and the
        opening it writes where `memory.opening` writes the greeting itself."""
        from flywheel.bus.instructions import names_in
        from flywheel.serve.served_memory import Served, greeted

        names = names_in([{"role": "system", "content": self.system}, {"role": "user", "content": question}])
        return greeted(Served(tuple(self.instructions)), names, self.memory.opened)


def opening_of(chat: list[dict]) -> str:
    """The start of the reply `chat` asks for (`Asked.chat` under `memory.opening`): the gateway's
    words before the model's; "" where it asks for a whole reply."""
    return chat[-1]["content"] if chat and chat[-1].get("role") == "assistant" else ""


def prompt_ids(tokenizer, chat: list[dict]) -> list[int]:
    """`chat`'s prompt as the gateway renders it: a reply's opening it ends with (`opening_of`)
    after the generation prompt."""
    opening = opening_of(chat)
    text = tokenizer.apply_chat_template(chat[:-1] if opening else chat, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text + opening, add_special_tokens=False)


def with_memory(system: str, name: str, hints: list[str], wishes: str = "words") -> str:
    """The system message with the newest `MEMORY` hints the person gave, as the app remembers them:
    their words, or with `wishes` `beside` / `instead` what they ask for, as the judge's teacher is
    told it (flywheel/judge/wishes.py)."""
    from flywheel.bus.instructions import addressed
    from flywheel.judge.wishes import Wish

    if not hints:
        return system
    kept = hints[-MEMORY:]
    said = (" ".join(f'"{hint}"' for hint in kept) if wishes == "words"
            else addressed(Wish(kept[::-1], wishes).told, [name]))  # newest first
    return f"{system} What {name} has told you about how they like replies: {said}"


def remember(hints: list[str], record: dict, config=None) -> None:
    """Keep the hint the judge (`config`: its `judge.next_state`) finds in the person's reaction
    to the first reply."""
    from flywheel.judge.next_state import classify_next_state, hint_of

    said = [{"role": "user", "content": record["said"]}]
    call, words = classify_next_state(said, record["question"], record["reply"], config)
    if words and (hint := hint_of(call, words, config)):
        hints.append(hint)


def reply_seed(user: User, session: int, reply: int) -> int:
    """The sampling seed of a session's first (0), second (1) or third (2) reply: distinct per user,
    session, reply (the first two as in the cap-of-60 trials, docs/experiments/personal-agent-trials.md)."""
    draw = user.seed * 1000 + session
    return draw * 2 + reply if reply < 2 else 10**9 + draw


def converse(client, model: str, user: User, session: int, trial_id: str, args, user_id: str | None = None,
             memory: list[str] | None = None, wishes: str = "words") -> dict:
    """The session's question, the first reply, the person's reaction and the reply to it; with
    `args.reactions` 2, also the person's reaction to that second reply when it answered something
    (a correction, a complaint or a new question; not thanks), and the reply to that, which nothing
    follows. Each reply samples with its own OpenAI `seed` (the user's seed, the session, which
    reply), so a trial run again on the same code meets the same draws (docs/experiments/personal-agent-trials.md).
    `user_id`: the person as the end user (`X-User-Id`), for a deployment that tells people apart;
    `memory`: the hints the app remembers (`with_memory`, with `wishes`)."""
    session_id = f"{trial_id}-s{session:03d}"
    headers = {"X-Session-Id": session_id, **({"X-User-Id": user_id} if user_id else {})}
    question = user.question(session)
    system = with_memory(user.system, user.name, memory or [], wishes)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]

    def reply(index: int) -> tuple[str, object]:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                temperature=args.temperature, seed=reply_seed(user, session, index),
                                                extra_headers=headers)
        text = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        return text, answer

    first, answer = reply(0)
    said, asked = user.react(first, session)
    messages.append({"role": "user", "content": said})
    second, _ = reply(1)
    record = {"session": session, "id": session_id, "version": version_of(answer.system_fingerprint), "question": question,
              "reply": first, "satisfied": user.satisfied(first, question), "said": said}
    if args.reactions == 2 and asked is not None:
        said_again, _ = user.react(second, session, asked, ask=False)
        messages.append({"role": "user", "content": said_again})
        reply(2)
        record |= {"second": second, "second_satisfied": user.satisfied(second, asked), "said_again": said_again}
    return record


async def verdicts(bus_url: str) -> dict[str, dict]:
    """{session id: what the judge said of its first reply (and of the second, when the person
    reacted to it), and how many tokens the teacher scored}."""
    from flywheel.bus import SAMPLE_SUBJECT, Bus
    from flywheel.judge.practice import JUDGE as PRACTICE

    bus = await Bus.connect(bus_url, name="personal-agent-drill")
    try:
        consumer, found = bus.consumer(SAMPLE_SUBJECT, f"drill-{os.getpid()}-{time.monotonic_ns()}"), {}
        while deliveries := await consumer.fetch(batch=256, timeout_s=2):
            for delivery in deliveries:
                sample = delivery.record
                if sample.judge == PRACTICE or not await bus.resolve(sample):  # practice: not the session's verdict
                    await delivery.ack()
                    continue
                turns = sample.details.get("turns") or [{}]
                taught = sum(not math.isnan(v) for values in sample.teacher_logprobs for v in values)
                found[sample.trajectory.session_id] = {"judge_class": turns[0].get("class"), "judge_score": turns[0].get("score"),
                                                       "hint": turns[0].get("hint"), "teacher_tokens": taught}
                if len(turns) > 2:  # the person reacted to the second reply too (--reactions 2)
                    found[sample.trajectory.session_id] |= {"second_class": turns[1].get("class"),
                                                            "second_score": turns[1].get("score"), "second_hint": turns[1].get("hint")}
                await delivery.ack()
        return found
    finally:
        await bus.close()


HEADERS = ["arm", "preference", "trials", "sessions to learn", "median", "learned", "rate in trial", "held-out before",
           "held-out rate", "answers before", "held-out answers", "judge agrees", "arith before", "arith after"]


def median_sessions(learned: list[int | None], cap: int) -> float | str | None:
    """The median of sessions to learn, a trial that never learned counting as more than `cap`
    (a median that takes one is a bound: `">cap"`, or `">x"` between a learned trial and one
    that never learned); None for no trials."""
    if not learned:
        return None
    ordered = sorted(math.inf if x is None else x for x in learned)
    lower, upper = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    if lower == math.inf:
        return f">{cap}"
    return f">{fmean((lower, cap)):g}" if upper == math.inf else fmean((lower, upper))


def summary_rows(trials: list[dict], arith_before: float | None) -> list[list]:
    """The results table (`HEADERS`): a row per arm and preference over its trials, and one per
    arm over all its preferences (`all`), with the base model's held-out arithmetic accuracy
    `arith_before`."""
    rows = []
    for arm in ARMS:
        prefs = sorted({t["pref"] for t in trials if t["arm"] == arm})
        for pref in [*prefs, "all"] if len(prefs) > 1 else prefs:
            mine = [t for t in trials if t["arm"] == arm and pref in (t["pref"], "all")]
            learned = [t["learned_at"] for t in mine]
            rows.append([arm, pref, len(mine), " ".join(str(x) if x else f">{t['cap']}" for x, t in zip(learned, mine)),
                         median_sessions(learned, max(t["cap"] for t in mine)),
                         f"{sum(x is not None for x in learned)}/{len(mine)}",
                         mean_of(t["satisfied_rate"] for t in mine), mean_of(t.get("heldout_before", {}).get("rate") for t in mine),
                         mean_of(t["heldout"]["rate"] for t in mine),
                         mean_of(t.get("heldout_before", {}).get("answers") for t in mine),
                         mean_of(t["heldout"].get("answers") for t in mine), mean_of(t["judge_agreement"] for t in mine),
                         arith_before, mean_of(t.get("arith_after") for t in mine)])
    return rows


def mean_of(values) -> float | None:
    """The mean of the values that are there (None for none)."""
    present = [v for v in values if v is not None]
    return fmean(present) if present else None

