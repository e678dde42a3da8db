"""Hint distillation's teacher (OpenClaw-RL's on-policy distillation): words that say how to do
better become a per-token signal.

**Hints** (`hints_of`): for each turn, what says how it should have been done. In order: feedback
`text` aimed at that turn (by `interaction_id`, or `turn_index` in the first conversation: the
feedback API's way to send a hint); the user's correction of it, as the judge read it
(`details["turns"][k]["hint"]` of the `next_state` judge, also inside a composite); feedback text
about the whole session (it applies to every turn; an environment's failure report is not a
hint). A turn without a hint gets no teacher, and no distillation term.

**The teacher** is the pinned model on the judge's own server (`serve.role: judge`: weights that
do not move while the policy learns), told the hint: the turn's request with the hint appended
to its last user message (`judge.teacher.hint_template`), rendered by the server's chat template.
It scores every token the policy sampled in that turn with one prefill-only engine request
(`/engine/score`, SGLang's `/generate` with `max_new_tokens: 0` underneath), at the temperature
the turn was sampled at. Its log-probabilities go on the sample, per segment, aligned with the
trajectory's tokens (NaN where no teacher spoke); the trainer adds w_opd · clip(log π_teacher −
log π_student) to those tokens' advantage (flywheel/train/distill.py). A turn drawn under a grammar (a
forced tool call, a JSON schema) gets no teacher: its tokens' distribution is the grammar's. Nor
does a reply the served memory opened (`Turn.opening`): told the hint, the teacher reads the
request without the opening its tokens went on from.

With `judge.teacher.top_k` k, the same request also returns the teacher's k likeliest tokens at
each of those positions (its distribution, not only its view of the token sampled), carried as
`Sample.teacher_top_ids` / `teacher_top_logprobs` for dense distillation (flywheel/train/distill.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from string import Template
from typing import Any

import httpx

from flywheel.bus import Trajectory
from flywheel.bus.arrays import Float64s, Int32s
from flywheel.bus.instructions import addressed, names_in
from flywheel.config.judge import TeacherConfig
from flywheel.judge.rule import turn_positions

log = logging.getLogger(__name__)

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def hints_of(trajectory: Trajectory, details: dict[str, Any]) -> dict[int, str]:
    """{position in `trajectory.turns`: hint} (see the module)."""
    positions = turn_positions(trajectory)
    aimed: dict[int, str] = {}
    session: list[str] = []
    for event in trajectory.feedback:
        if not event.text or event.kind != "feedback" or event.text.startswith("episode failed"):
            continue
        key = event.interaction_id if event.interaction_id is not None else event.turn_index
        if key is None:
            session.append(event.text)
        elif key in positions:
            aimed[positions[key]] = event.text
    corrections = _judged_hints(details)
    hints = {}
    for k in range(len(trajectory.turns)):
        hint = aimed.get(k) or corrections.get(k) or " ".join(session)
        if hint.strip():
            hints[k] = hint.strip()
    return hints


def _judged_hints(details: dict[str, Any]) -> dict[int, str]:
    """The hints a judge read in the users' corrections, also from a composite's components."""
    found: dict[int, str] = {}
    for k, turn in enumerate(details.get("turns") or []):
        if isinstance(turn, dict) and turn.get("hint"):
            found[k] = turn["hint"]
    for component in (details.get("components") or {}).values():
        for k, hint in _judged_hints(component.get("details") or {}).items():
            found.setdefault(k, hint)
    return found


@dataclass
class Teaching:
    """What a teacher said of a trajectory, per segment, aligned with its tokens (the `Sample`
    fields of the same names); all empty when no turn was taught."""

    logprobs: list[Float64s] = field(default_factory=list)
    top_k: int = 0
    top_ids: list[Int32s] = field(default_factory=list)
    top_logprobs: list[Float64s] = field(default_factory=list)

    def sample_fields(self) -> dict[str, Any]:
        return {"teacher_logprobs": self.logprobs, "teacher_top_k": self.top_k, "teacher_top_ids": self.top_ids,
                "teacher_top_logprobs": self.top_logprobs}


class Teacher:
    def __init__(self, config: TeacherConfig, server_url: str, api_key: str | None = None, timeout_s: float = 120.0):
        self.config = config
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=server_url, headers=headers, timeout=timeout_s)
        self.counts = {"hinted_turns": 0, "scored_tokens": 0, "failures": 0}

    async def teach(self, trajectory: Trajectory, hints: dict[int, str]) -> Teaching:
        """The teacher's log-probabilities (and with `top_k` its likeliest tokens), per segment,
        NaN (-1) where no hint reached a turn; empty when no turn could be taught."""
        k = self.config.top_k
        taught = Teaching([Float64s([math.nan] * len(s.token_ids)) for s in trajectory.segments], k,
                          [Int32s([-1] * (len(s.token_ids) * k)) for s in trajectory.segments] if k else [],
                          [Float64s([math.nan] * (len(s.token_ids) * k)) for s in trajectory.segments] if k else [])
        position, any_taught = 0, False
        for index, segment in enumerate(trajectory.segments):
            for _, start, end in segment.turn_spans:
                turn = trajectory.turns[position]
                hint = hints.get(position)
                position += 1
                if hint is None or end == start or turn.opening or any(turn.sampling.get(key) for key in GRAMMAR_KEYS):
                    continue
                scored = await self.score(self.told(turn.messages, hint), list(segment.token_ids[start:end]),
                                          float(turn.sampling.get("temperature", 1.0)), k)
                if scored is None:
                    continue
                taught.logprobs[index][start:end] = Float64s(scored["logprobs"])
                if k:
                    taught.top_ids[index][start * k:end * k] = Int32s(i for ids in scored["top_ids"] for i in ids)
                    taught.top_logprobs[index][start * k:end * k] = Float64s(v for values in scored["top_logprobs"] for v in values)
                any_taught = True
                self.counts["hinted_turns"] += 1
                self.counts["scored_tokens"] += end - start
        return taught if any_taught else Teaching()

    async def score(self, messages: list[dict[str, Any]], output_ids: list[int], temperature: float = 1.0,
                    k: int = 0) -> dict[str, Any] | None:
        """The score server's answer for these tokens after `messages` (`logprobs`, and with `k`
        `top_ids` and `top_logprobs`, k per token); None when it failed or answered out of shape."""
        try:
            response = await self.http.post("/engine/score", json={
                "messages": messages, "output_ids": output_ids, "temperature": temperature or 1.0,
                **({"top_k": k} if k else {})})
            response.raise_for_status()
            scored = response.json()
            n = len(output_ids)
            shaped = len(scored["logprobs"]) == n and (not k or (
                len(scored["top_ids"]) == len(scored["top_logprobs"]) == n
                and all(len(ids) == len(values) == k for ids, values in zip(scored["top_ids"], scored["top_logprobs"]))))
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            self.counts["failures"] += 1
            log.warning("the teacher could not score a turn: %s", exc)
            return None
        if not shaped:
            self.counts["failures"] += 1
            log.warning("the teacher's answer does not cover the %d tokens it was asked about", len(output_ids))
            return None
        return scored

    def told(self, messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
        return told(messages, hint, self.config)

    async def close(self) -> None:
        await self.http.aclose()


def told(messages: list[dict[str, Any]], hint: str, config: TeacherConfig) -> list[dict[str, Any]]:
    """A turn's request told `hint`: appended to its last user message (a user message of its own
    when there is none), by `config.hint_template`; a greeting it shows is the person's, by the
    name the request gives them (flywheel/bus/instructions.py, `addressed`)."""
    hint = addressed(hint[: config.max_hint_chars], names_in(messages))
    addition = Template(config.hint_template).safe_substitute(hint=hint)
    messages = [dict(m) for m in messages]
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                message["content"] = [*content, {"type": "text", "text": addition}]
            else:
                message["content"] = f"{content or ''}{addition}"
            return messages
    return [*messages, {"role": "user", "content": addition.strip()}]
