"""The rule judge: rewards from explicit feedback and environment verdicts, nothing inferred.

- The trajectory's reward is the mean of its session-level feedback rewards (`turn_index`
  None), from users or environments alike.
- Feedback about one turn becomes that turn's reward (the mean, if several); turns without
  any get 0.0 in `turn_rewards`. With no session-level reward, the outcome is the mean of all
  per-turn feedback.
- A trajectory with no reward at all cannot be scored by this judge: `score` raises
  `Unscorable("no reward", ...)` and the judge loop reports it, never as a silent zero.
"""

from __future__ import annotations

from statistics import fmean

from bus import Trajectory
from judge.base import Judge, Unscorable, Verdict


class RuleJudge(Judge):
    name = "rule"

    async def score(self, trajectory: Trajectory) -> Verdict:
        session = [e.reward for e in trajectory.feedback if e.reward is not None and e.turn_index is None]
        per_turn: dict[int, list[float]] = {}
        for event in trajectory.feedback:
            if event.reward is not None and event.turn_index is not None:
                per_turn.setdefault(event.turn_index, []).append(event.reward)
        if not session and not per_turn:
            raise Unscorable("no reward", "no feedback with a reward in the trajectory")
        turn_rewards = [fmean(per_turn[t.turn_index]) if t.turn_index in per_turn else 0.0 for t in trajectory.turns]
        reward = fmean(session) if session else fmean(r for rs in per_turn.values() for r in rs)
        return Verdict(reward, turn_rewards, {"session_feedback": len(session), "turn_feedback": sum(map(len, per_turn.values()))})
