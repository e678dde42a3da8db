"""The `llm` judge: an LLM behind any OpenAI-compatible endpoint scores each assistant turn.

For every turn it sends `votes` requests (k), each with the configured prompt templates filled in
for that turn (`flywheel/judge/prompt.py`: the task context, what the turn was asked, the reply, and the
next state and any feedback about it, all fenced with a fresh nonce per request), at
`temperature`. Each reply is parsed for the judge's final labelled score (`flywheel/judge/parse.py`).

- `next_state` mode (the default; OpenClaw-RL's process reward): the judge is asked whether what
  followed the reply shows it worked, votes -1, 0 or 1; the majority wins, a tie is 0. Only turns
  something followed are judged: a turn with nothing after it takes the session feedback's
  reward, or is listed in `details["unjudged_turns"]` (0, kept out of the loss by the trainer).
  The outcome is the session feedback's reward, else the mean of the judged turns.
- `score` mode: the turn's score is the mean of its valid votes, mapped from [score_min,
  score_max] to a reward in [0, 1]; the outcome follows from the turn rewards (`outcome`: mean,
  last or min).

A turn with fewer than `min_valid_votes` valid votes (replies without a score, scores out of
range, requests that failed after their retries) makes the whole trajectory `Unscorable`, with
the reason: `endpoint error` when every missing vote was lost to the endpoint, else
`no valid vote`. Nothing is scored zero for want of an answer.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from statistics import fmean

import httpx

from flywheel.bus import Trajectory
from flywheel.config.judge import LLMJudgeConfig
from flywheel.judge import transcript
from flywheel.judge.base import Judge, Unscorable, Verdict, outcome_of
from flywheel.judge.parse import Vote, parse_score
from flywheel.judge.prompt import PromptBuilder
from flywheel.judge_client.endpoint import EndpointError, JudgeEndpoint

ENDPOINT_ERROR = "endpoint error"


@dataclass
class TurnVotes:
    position: int
    votes: list[Vote]
    last_problem_text: str
    """The last invalid reply (or endpoint error message), for the unscored reason."""

    @property
    def valid(self) -> list[float]:
        return [v.score for v in self.votes if v.score is not None]


class LLMJudge(Judge):
    name = "llm"

    def __init__(self, config: LLMJudgeConfig, base_url: str, api_key: str, model: str):
        self.config = config
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.prompts = PromptBuilder(config)
        self.endpoint: JudgeEndpoint | None = None
        self.votes = 0
        self.valid_votes = 0
        self.weights: str | None = None
        """The weight version the endpoint reports (a Flywheel server's `/health`), if it does."""

    async def start(self) -> None:
        self.endpoint = JudgeEndpoint(self.config, self.base_url, self.api_key, self.model)
        self.weights = await weight_version(self.base_url)

    @property
    def identity(self) -> str:
        weights = f", weights v{self.weights}" if self.weights is not None else ""
        return f"{self.model} at {self.base_url}{weights}"

    async def close(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    async def score(self, trajectory: Trajectory) -> Verdict:
        if not trajectory.turns:
            raise Unscorable("no turns", "the trajectory has no assistant turn to score")
        if self.config.mode == "next_state":
            return await self._score_next_states(trajectory)
        turns = await asyncio.gather(*(self._judge_turn(trajectory, i) for i in range(len(trajectory.turns))))
        for turn in turns:
            self._check(trajectory, turn)
        cfg = self.config
        scores = [fmean(turn.valid) for turn in turns]
        turn_rewards = [(s - cfg.score_min) / (cfg.score_max - cfg.score_min) for s in scores]
        return Verdict(outcome_of(turn_rewards, cfg.outcome), turn_rewards, self._details(turns, scores))

    async def _score_next_states(self, trajectory: Trajectory) -> Verdict:
        """Each turn something followed (in its conversation, or feedback about it) gets the
        majority of its votes (-1, 0, 1; a tie is 0); a turn nothing followed is not judged: the
        session feedback's reward when there is some, else 0 listed in `unjudged_turns`, which the
        trainer keeps out of the loss."""
        positions = [k for k in range(len(trajectory.turns))
                     if transcript.next_state(trajectory, k) or transcript.feedback_about(trajectory, k)]
        turns = await asyncio.gather(*(self._judge_turn(trajectory, k) for k in positions))
        for turn in turns:
            self._check(trajectory, turn)
        session = [e.reward for e in trajectory.feedback
                   if e.reward is not None and e.turn_index is None and e.interaction_id is None]
        if not turns and not session:
            raise Unscorable("nothing followed", "no turn has a next state or feedback, and the session has no reward")
        judged = {turn.position: majority(turn.valid) for turn in turns}
        fallback = fmean(session) if session else 0.0
        turn_rewards = [judged.get(k, fallback) for k in range(len(trajectory.turns))]
        details = self._details(turns, list(judged.values()))
        details["unjudged_turns"] = [] if session else [k for k in range(len(trajectory.turns)) if k not in judged]
        reward = fmean(session) if session else fmean(judged.values())
        return Verdict(reward, turn_rewards, details)

    def _details(self, turns: list[TurnVotes], scores: list[float]) -> dict:
        problems = Counter(v.problem for turn in turns for v in turn.votes if not v.valid)
        return {
            "model": self.model,
            "positions": [turn.position for turn in turns],
            "scores": scores,
            "votes": [[v.score for v in turn.votes] for turn in turns],
            "invalid_votes": dict(problems),
        }

    def _check(self, trajectory: Trajectory, turn: TurnVotes) -> None:
        if len(turn.valid) >= self.config.min_valid_votes:
            return
        problems = Counter(v.problem for v in turn.votes if not v.valid)
        category = ENDPOINT_ERROR if set(problems) == {ENDPOINT_ERROR} else "no valid vote"
        listed = ", ".join(f"{problem} x{n}" for problem, n in problems.items())
        raise Unscorable(
            category,
            f"turn {turn.position + 1} of {len(trajectory.turns)}: {len(turn.valid)} of {len(turn.votes)} votes valid "
            f"({listed}; need {self.config.min_valid_votes}); last: {turn.last_problem_text[:160]!r}",
        )

    async def _judge_turn(self, trajectory: Trajectory, position: int) -> TurnVotes:
        replies = await asyncio.gather(*(self._ask(trajectory, position) for _ in range(self.config.votes)))
        last_problem = next((text for vote, text in reversed(replies) if not vote.valid), "")
        turn = TurnVotes(position, [vote for vote, _ in replies], last_problem)
        self.votes += len(turn.votes)
        self.valid_votes += len(turn.valid)
        return turn

    async def _ask(self, trajectory: Trajectory, position: int) -> tuple[Vote, str]:
        """One vote on one turn, and the reply it was read from (or the endpoint's error)."""
        assert self.endpoint is not None, "LLMJudge.start() was not awaited"
        messages, _ = self.prompts.render(trajectory, position)
        try:
            reply = await self.endpoint.complete(messages, session_id=f"judge/{trajectory.id}")
        except EndpointError as error:
            return Vote(None, ENDPOINT_ERROR), str(error)
        return parse_score(reply, *self.config.scale), reply

    def stats(self) -> dict[str, int]:
        """Requests, retries and failed requests; votes cast and how many held a valid score."""
        endpoint = self.endpoint.stats() if self.endpoint else {}
        return {**endpoint, "votes": self.votes, "valid_votes": self.valid_votes}


async def weight_version(base_url: str) -> str | None:
    """The weight version a Flywheel server reports at `/health` (None from other endpoints)."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            version = (await http.get(f"{root}/health")).json().get("weight_version")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return None if version is None else str(version)


def majority(votes: list[float]) -> float:
    """The most common vote; a tie between the most common is 0 (OpenClaw-RL's PRM)."""
    counts = Counter(votes).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return 0.0
    return counts[0][0]
