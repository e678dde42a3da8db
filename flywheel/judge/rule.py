"""The rule judge: rewards from explicit feedback and environment verdicts, nothing inferred.

- The trajectory's reward is the mean of its session-level feedback rewards (neither
  `interaction_id` nor `turn_index`), from users or environments alike.
- Feedback about one turn becomes that turn's reward (the mean, if several); turns without
  any get 0.0 in `turn_rewards`. The turn is the one whose id is the feedback's
  `interaction_id`, or, by `turn_index`, the turn of the session's first conversation (thread 0)
  with that index: a sub-agent's turns share indices with the main agent's, and only the id
  names them. Feedback about a turn that is not in this trajectory (another piece of a long
  session, a retry's orphan) is not this trajectory's. With no session-level reward, the outcome
  is the mean of the per-turn feedback about its turns.
- A trajectory with no reward at all cannot be scored by this judge: `score` raises
  `Unscorable("no reward", ...)` and the judge loop reports it, never as a silent zero.
"""

from __future__ import annotations

from statistics import fmean

from flywheel.bus import Trajectory
from flywheel.judge.base import Judge, Unscorable, Verdict


class RuleJudge(Judge):
    name = "rule"

    async def score(self, trajectory: Trajectory) -> Verdict:
        session = [e.reward for e in trajectory.feedback
                   if e.reward is not None and e.turn_index is None and e.interaction_id is None]
        position = turn_positions(trajectory)
        per_turn: dict[int, list[float]] = {}
        for event in trajectory.feedback:
            key = event.interaction_id if event.interaction_id is not None else event.turn_index
            if event.reward is not None and key in position:
                per_turn.setdefault(position[key], []).append(event.reward)
        if not session and not per_turn:
            raise Unscorable("no reward", "no feedback with a reward about this trajectory")
        turn_rewards = [fmean(per_turn[k]) if k in per_turn else 0.0 for k in range(len(trajectory.turns))]
        reward = fmean(session) if session else fmean(r for rs in per_turn.values() for r in rs)
        return Verdict(reward, turn_rewards, {"session_feedback": len(session), "turn_feedback": sum(map(len, per_turn.values()))})


def turn_positions(trajectory: Trajectory) -> dict[str | int, int]:
    """Where feedback about one turn lands: the turn's place in `trajectory.turns`, by its
    interaction id, and by its `turn_index` for the turns of thread 0."""
    out: dict[str | int, int] = {}
    for k, (turn, (thread, _)) in enumerate(zip(trajectory.turns, trajectory.thread_positions())):
        out[turn.id] = k
        if thread == 0:
            out.setdefault(turn.turn_index, k)
    return out
