"""Practice (`judge.teacher.practice` K): more learning from each correction than the one reply it
was about.

For each turn judged below zero that got a hint (a correction: by the turn's own reward, or by
the outcome where the turn has none of its own: `corrected_turns`), the judge asks the policy's server
(`/engine/practice`, flywheel/serve/practice.py) for K replies by the same adapter to the turn's
exact context (the tokens before its reply in its segment), sampled as the turn was (its
`sampling`). The teacher, told the turn's hint, scores each (flywheel/judge/teacher.py), and each
becomes a sample of its own: a one-turn trajectory of the same tenant, user, adapter and consent,
with the engine's tokens, log-probabilities and versions. The replies form one task group
(`practice:<trajectory>:<turn>`). By default its rewards are equal (0), so their RL advantage is
0 and the teacher's term alone moves the adapter: no judge of the replies is needed, the hint
teaches every one of them as it teaches the first. (`bench/hint_update.py` measured the update
alone: four replies to each corrected question, each taught, raised the wanted first token
further than one.) With `judge.teacher.practice_reward: checks`, where a rule can check every
aspect the person's corrections ask (flywheel/formats/wish_checks.py), the group's rewards rank
its replies by how much of it each does: it then also learns which of them did what was asked,
past what the teacher would write. A reply that does not answer the request (the base model
finds it no likelier told the request than not: flywheel/judge/relevance.py) ranks below every
one that does, whatever the wish, so the adapter does not learn to stop answering.
`details["checked"]` names what was checked (the aspects, `answers`); the trainer gives such a
sample's RL term its full weight, `actor.rl_coef_hinted` notwithstanding.

With `judge.teacher.practice_history` H, the judge also remembers the requests that opened each
person's newest H conversations (the first practisable turn's exact context; a later turn's
holds the conversation so far, corrections included: flywheel/judge/people_memory.py), and a
correction replays each of them as it replays the corrected turn: K replies by the person's
adapter, taught the correction's hint, checked alike, a group per request
(`practice:<trajectory>:<turn>:<request's turn>`, `details["replayed"]` naming that turn). A
person who says "shorter" once then practises it on several of their questions, as they will
ask new ones, not only on the one the correction was about.

With `judge.teacher.practice_prompt: bare`, a request the served memory put the person's
instructions in (`Turn.instructions`) is practised without them: its messages as the person sent
them (`unplaced`), rendered again by the policy's server, so the adapter answers untold and the
teacher, told the correction and the instructions it holds, teaches it what they ask: the memory
distilled into the adapter, which the served instructions then add to.

Not practised or remembered: a turn sampled greedily (its replies would all be one) or under a grammar (the
teacher does not score those), a turn of the shared weights (no adapter), a trajectory that may
not be trained; the server leaves out a reply that holds personal data under the tenant's policy. Ids are fixed by the trajectory, turn and reply, so a trajectory judged again
after a crash practises again and the bus drops the repeats. A failure (the server, the engine,
the teacher) costs the practice, logged and counted, never the trajectory's own sample.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import msgspec

from flywheel.bus import Sample, Trajectory, Turn
from flywheel.bus.instructions import unplaced
from flywheel.bus.stitch import stitch, without_tokens
from flywheel.formats.wish_checks import checkable, rewards
from flywheel.judge.people_memory import PeopleMemory
from flywheel.judge.relevance import information
from flywheel.judge.teacher import GRAMMAR_KEYS, Teacher
from flywheel.judge.wishes import Wish

log = logging.getLogger(__name__)

JUDGE = "practice"
"""The `judge` of a practice sample."""


def corrected_turns(sample: Sample, trajectory: Trajectory) -> set[int]:
    """The turns of `sample`'s trajectory judged below zero: by their own reward, or by the
    outcome (owed to every turn) where their own is 0 (none: a rule judge's turn without
    feedback, a next-state judge's unjudged turn) or not given."""
    own = list(sample.turn_rewards) + [0.0] * (len(trajectory.turns) - len(sample.turn_rewards))
    return {k for k, reward in enumerate(own) if reward < 0 or (reward == 0 and sample.reward < 0)}


def practisable(turn: Turn) -> bool:
    return (turn.adapter is not None and float(turn.sampling.get("temperature", 1.0)) > 0
            and not any(turn.sampling.get(key) for key in GRAMMAR_KEYS))


class Request(NamedTuple):
    """A practisable turn and its exact context (the tokens before its reply in its segment)."""

    turn: Turn
    prompt: list[int]


class Practice:
    def __init__(self, replies: int, server_url: str, teacher: Teacher, api_key: str | None = None,
                 timeout_s: float = 300.0, checks: bool = False, history: int = 0, bare: str | None = None):
        self.replies, self.teacher, self.checks = replies, teacher, checks
        self.bare_template = bare
        """`memory.template` where requests are practised without the served instructions
        (`practice_prompt: bare`); None: as served."""
        self.requests: PeopleMemory[Request] | None = (
            PeopleMemory(history, key=lambda request: request.turn.id) if history else None)
        """Each person's newest practisable requests, replayed with their corrections."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=server_url, headers=headers, timeout=timeout_s)
        self.counts = {"turns": 0, "replayed": 0, "samples": 0, "failures": 0, "checked_turns": 0}

    async def samples(self, trajectory: Trajectory, wishes: dict[int, Wish], corrected: set[int]) -> list[Sample]:
        """The practice samples of `trajectory`'s corrected turns that have hints (`wishes`: each
        turn's, as the teacher was told it, of its corrections and the person's remembered ones:
        flywheel/judge/hint_memory.py), and of the person's earlier requests replayed with them;
        see the module."""
        if not trajectory.consent:
            return []
        requests = list(_requests(trajectory))
        own = {turn.id for turn in trajectory.turns}  # judged again after a crash: not replayed as its own earlier
        earlier = [r for r in self.requests.recall(trajectory) if r.turn.id not in own] if self.requests else []
        groups = []
        for k, request in requests:
            if k in corrected and k in wishes:
                aspects = wishes[k].aspects if self.checks else []
                groups += [self._practise(trajectory, k, each, wishes[k].told, aspects) for each in (request, *earlier)]
        if self.requests:
            self.requests.keep(trajectory, [request for _, request in requests[:1]])  # the one that opened it
        return [sample for group in await asyncio.gather(*groups) for sample in group]  # the engine batches them

    async def _practise(self, trajectory: Trajectory, k: int, request: Request, hint: str,
                        aspects: list[str]) -> list[Sample]:
        """Turn `k`'s correction practised on `request` (the turn's own, or an earlier one replayed)."""
        turn, replayed = request.turn, request.turn.id != trajectory.turns[k].id
        group = f"{k}:{turn.id}" if replayed else f"{k}"
        bare = (unplaced(turn.messages, turn.instructions, self.bare_template)
                if self.bare_template and turn.instructions else None)
        try:
            response = await self.http.post("/engine/practice", json={
                "adapter": turn.adapter, "tenant": trajectory.tenant, "n": self.replies, "sampling_params": turn.sampling,
                **({"input_ids": request.prompt} if bare is None else {"messages": bare})})
            response.raise_for_status()
            answer = response.json()
            replies = [r for r in answer["replies"] if r["output_ids"]]
            if bare is not None:  # asked as the person sent it: the prompt the server rendered
                request = Request(msgspec.structs.replace(turn, messages=bare, instructions=[]), answer["prompt_ids"])
            practices = [_trajectory(trajectory, group, j, request, reply) for j, reply in enumerate(replies)]
            teachings = await asyncio.gather(*(self.teacher.teach(practice, {0: hint}) for practice in practices))
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            self.counts["failures"] += 1
            log.warning("no practice of turn %s for turn %d of %s: %s", turn.id, k, trajectory.id, exc)
            return []
        taught = [(p, t, r) for p, t, r in zip(practices, teachings, replies) if t.logprobs]
        if len(taught) < 2:  # a group of one would be judged against the running baseline
            return []
        checked = await self._checked(request.turn, aspects, [reply for _, _, reply in taught]) if self.checks else None
        self.counts["turns"] += 1
        self.counts["replayed"] += replayed
        self.counts["samples"] += len(taught)
        self.counts["checked_turns"] += checked is not None
        details = {"practice_of": trajectory.id, "turn": k, **({"replayed": turn.id} if replayed else {}),
                   **({"checked": checked[0]} if checked else {})}
        samples = []
        for (practice, teaching, _), reward in zip(taught, checked[1] if checked else [0.0] * len(taught)):
            practice.group_size = len(taught)
            samples.append(Sample(
                id=practice.id, trajectory=practice, reward=reward, turn_rewards=[0.0], judge=JUDGE, details={**details},
                tenant=trajectory.tenant, user_id=trajectory.user_id, consent=trajectory.consent, **teaching.sample_fields()))
        return samples

    async def _checked(self, turn: Turn, aspects: list[str], replies: list[dict[str, Any]]
                       ) -> tuple[list[str], list[float]] | None:
        """What was checked of a group's replies (the aspects a rule checks, and whether each
        answers the request) and their rewards by it; None where the checks cannot tell them apart."""
        messages = turn.messages or []
        gains = (await asyncio.gather(*(information(self.teacher, messages, reply["output_ids"], turn.instructions)
                                        for reply in replies))
                 if messages else [None])  # concurrent: the engine batches the prefills
        answered = None if None in gains else [gain > 0 for gain in gains]
        ranked = rewards(aspects, [reply["text"] for reply in replies], messages, answered)
        if ranked is None:
            return None
        return [*(aspects if checkable(aspects) else []), *(["answers"] if answered else [])], ranked

    async def close(self) -> None:
        await self.http.aclose()


def _requests(trajectory: Trajectory) -> Iterator[tuple[int, Request]]:
    """The trajectory's practisable turns, by index, with their contexts."""
    position = 0
    for segment in trajectory.segments:
        for _, start, _ in segment.turn_spans:
            k, turn = position, trajectory.turns[position]
            position += 1
            if practisable(turn):
                yield k, Request(turn, list(segment.token_ids[:start]))


def _trajectory(trajectory: Trajectory, group: str, j: int, request: Request, reply: dict[str, Any]) -> Trajectory:
    """Reply `j` to `request`'s context, practised for `trajectory` (`group`: the corrected turn's
    index, and the request's turn where it is an earlier one), as a one-turn trajectory (its
    tokens in its segment)."""
    turn, prompt = request
    n = len(reply["output_ids"])
    if len(reply["logprobs"]) != n or len(reply["versions"]) != n:
        raise ValueError(f"practice reply {j}: {n} tokens, {len(reply['logprobs'])} log-probs, "
                         f"{len(reply['versions'])} versions")
    practice_id = f"{trajectory.id}:practice:{group}:{j}"
    practice_turn = Turn(
        id=practice_id, session_id=turn.session_id, tenant=trajectory.tenant, user_id=trajectory.user_id,
        adapter=turn.adapter, consent=trajectory.consent, turn_index=turn.turn_index, model=turn.model,
        endpoint=turn.endpoint, messages=turn.messages, instructions=turn.instructions, prompt=turn.prompt,
        response=_response(turn, reply["text"]),
        prompt_ids=prompt, output_ids=reply["output_ids"], output_logprobs=reply["logprobs"],
        output_versions=reply["versions"], finish_reason=reply["finish_reason"], sampling=turn.sampling)
    return Trajectory(
        id=practice_id, session_id=turn.session_id, tenant=trajectory.tenant,
        user_id=trajectory.user_id, adapter=turn.adapter, consent=trajectory.consent, task_id=f"practice:{trajectory.id}:{group}",
        segments=stitch([practice_turn]), turns=[without_tokens(practice_turn)], close_reason="done")


def _response(turn: Turn, text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text} if turn.endpoint != "completions" else {"text": text}
