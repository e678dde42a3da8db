"""The `next_state` judge: per-turn rewards from what followed each assistant reply, no judge model.

Each turn k is classified from the evidence about it, the first that decides (a user's words are
read by `judge.next_state.reader`: the learned reader, flywheel/judge/reaction_reader.py, or the
phrasing rules, next_state_rules.py; tool output by next_state_tool_output.py):
1. feedback about the turn with a `reward` (by `interaction_id`, or by `turn_index` for thread-0
   turns: `flywheel.judge.rule.turn_positions`): its sign decides, the class comes from its text when
   the text agrees, else it is `rated`;
2. feedback text about the turn, when it holds a cue;
3. `trajectory.next_states[k]`, what followed the reply in its own conversation: the user's next
   message (read against the turn's own request, `turns[k].messages`, for retries) and, when it
   says nothing, tool results (exit codes, tracebacks, test summaries).
A turn's reward is the class's polarity: +1 (acceptance, thanks, moving_on, tests_passing,
clean_tool_result), -1 (correction, complaint, retry, error, tests_failing), 0 (unclear).

A turn with nothing after it (its conversation's last, or an empty next state) and no feedback
about it is not judged from nothing: it gets the session-level feedback's reward when there is
some, else 0.0 with its position in `details["unjudged_turns"]`, so that the trainer keeps it
out of the loss (a Verdict needs one reward per turn; the 0.0 is a placeholder, not a score).
Nor is a turn whose evidence the judge cannot read (`unclear`): its 0.0 is unjudged too, and not
part of the outcome, since a 0 is not neutral to a trainer that takes a lone conversation's
outcome against a running baseline (after a run of corrections it would be a push up for the
reply the person could not be understood about).

The outcome (`reward`) is the mean of the session-level feedback (neither `interaction_id` nor
`turn_index`): its rewards, or, when it has none, the polarity of its texts; without any, the
mean of the judged turns. With no judged turn and no session feedback: `Unscorable("nothing
followed")`. `details["turns"]` holds each turn's class, score, source and the cue that decided,
and for a negative reaction in the user's words the `hint` (`hint_of`), for hint distillation.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from statistics import fmean
from typing import Any

from flywheel.bus import SessionEvent, Trajectory, Turn
from flywheel.bus.instructions import persons_words
from flywheel.config.judge import NextStateJudgeConfig
from flywheel.judge.base import Judge, Unscorable, Verdict
from flywheel.judge.next_state_classes import Call
from flywheel.judge.next_state_rules import classify_user_text, contrast_split
from flywheel.judge.next_state_tool_output import classify_tool_output
from flywheel.judge.reaction_reader import reader
from flywheel.judge.rule import turn_positions
from flywheel.judge.transcript import (
    Message,
    body_text,
    content_text,
    next_state,
    response_message,
)

TOOL_ROLES = ("tool", "function", "ipython")
_SEVERITY = ("tests_failing", "error", "tests_passing", "clean_tool_result", "unclear")
_LEAD = re.compile(
    r"^\s*(?:(?:nope|nah|nein|wrong|incorrect|stop|wait|close|almost|hmm+|hm+|well|ok(?:ay)?|so|actually|sorry|"
    r"thanks|thank you|thx|ty|grazie|merci|danke|not quite|not exactly|that'?s (?:wrong|not (?:it|right|correct)))"
    r"(?:\s*[,.!:;-]+\s*|\s+)|(?:no|non)\s*[,.!:;-]+\s*)", re.I)


def hint_for(text: str) -> str | None:
    """How to do better, in the user's own words: for a message classified as a correction, the
    message trimmed to its instruction (after "thanks, but", without a leading "No,", "hmm,",
    "not quite -"); None for any other message."""
    call = classify_user_text(text)
    if call.label != "correction":
        return None
    if call.after_contrast and (split := contrast_split(text)):
        text = split[2]
    while m := _LEAD.match(text):
        if not text[m.end():].strip():
            break
        text = text[m.end():]
    return text.strip()


_TOOLISH = ("tests_failing", "tests_passing", "error")
"""What the rules read in user words under either reader: pasted tool output and test results."""


def read_user_text(text: str, request: str = "", reply: str = "", config: NextStateJudgeConfig | None = None) -> Call:
    """The class of a user's words after a reply to `request` (see `NextStateJudgeConfig.reader`)."""
    config = config or NextStateJudgeConfig()
    rules = classify_user_text(text, request, reply, config.retry_overlap, config.retry_min_shared)
    if config.reader == "rules" or rules.label in _TOOLISH or not text.strip():
        return rules
    reading = reader().read(text, request, reply, rules.label)
    return Call(reading.label, f"reader: {reading.label} ({reading.probability:.2f})")


def hint_of(call: Call, words: str, config: NextStateJudgeConfig | None = None) -> str | None:
    """The hint in user words read as `call`: with the learned reader, the whole of a correction
    or a complaint (a complaint says what displeased, which the teacher reads as well as an
    instruction); with the rules, a correction trimmed to its instruction (`hint_for`)."""
    if (config or NextStateJudgeConfig()).reader == "rules":
        return hint_for(words) if call.label == "correction" else None
    if call.label not in ("correction", "complaint"):
        return None
    return words.strip() or None


def request_text(turn: Turn) -> str:
    """What the turn's conversation last asked for: its last user message (or the text prompt), in
    the person's words: the first without the instructions the served memory put before them
    (`Turn.instructions`), which would make a reaction asking for the same look like the request
    said again."""
    users = [m for m in turn.messages if m.get("role") == "user"]
    if not users:
        return turn.prompt or ""
    text = content_text(users[-1].get("content"))
    return persons_words(text, turn.instructions) if len(users) == 1 else text


def classify_next_state(messages: list[Message], request: str = "", reply: str = "",
                        config: NextStateJudgeConfig | None = None) -> tuple[Call, str | None]:
    """The class of what followed a reply, and the user's words that decided it (None when tool
    results decided). The user's last message decides unless it says nothing; then the tool
    results do, the worst of them (a failing test run, an error, passing tests, clean output)."""
    config = config or NextStateJudgeConfig()
    users = [body_text(m) for m in messages if m.get("role") == "user"]
    tools = [classify_tool_output(body_text(m)) for m in messages if m.get("role") in TOOL_ROLES]
    if users:
        call = read_user_text(users[-1], request, reply, config)
        if call.label != "unclear" or not tools:
            return call, users[-1]
    if tools:
        worst = min(tools, key=lambda c: _SEVERITY.index(c.label))
        suffix = f" ({len(tools)} tool results)" if len(tools) > 1 else ""
        return Call(worst.label, worst.cue + suffix), None
    return Call("unclear", "no user message or tool result"), None


class NextStateJudge(Judge):
    name = "next_state"

    def __init__(self, config: NextStateJudgeConfig | None = None):
        self.config = config or NextStateJudgeConfig()

    async def start(self) -> None:
        """Train the learned reader now, off the event loop (it takes seconds; the first
        judgement would otherwise hold the loop that long)."""
        if self.config.reader == "learned":
            await asyncio.to_thread(reader)

    async def score(self, trajectory: Trajectory) -> Verdict:
        position = turn_positions(trajectory)
        session, about = [], {}
        for event in trajectory.feedback:
            key = event.interaction_id if event.interaction_id is not None else event.turn_index
            if event.kind != "feedback":
                continue
            if key is None:
                session.append(event)
            elif key in position:
                about.setdefault(position[key], []).append(event)
        session_reward = self._session_reward(session)
        entries = [self._turn(trajectory, k, about.get(k, []), session_reward) for k in range(len(trajectory.turns))]
        judged = [e["score"] for e in entries if e["source"] in ("feedback", "next_state") and e["class"] != "unclear"]
        if session_reward is None and not judged:
            raise Unscorable("nothing followed", f"{len(trajectory.turns)} turn(s), none with a next state or "
                             "feedback about it that could be read, and no session feedback")
        details: dict[str, Any] = {
            "turns": entries,
            "unjudged_turns": [e["position"] for e in entries if e["source"] is None or e["class"] == "unclear"],
            "classes": dict(Counter(e["class"] for e in entries if e["class"])),
            "outcome_from": "session feedback" if session_reward is not None else "judged turns",
        }
        reward = session_reward if session_reward is not None else fmean(judged)
        return Verdict(reward, [float(e["score"]) for e in entries], details)

    def _session_reward(self, events: list[SessionEvent]) -> float | None:
        rewards = [e.reward for e in events if e.reward is not None]
        if rewards:
            return fmean(rewards)
        calls = [read_user_text(e.text, config=self.config) for e in events if e.text]
        signs = [c.polarity for c in calls if c.label != "unclear"]
        return fmean(signs) if signs else None

    def _turn(self, trajectory: Trajectory, k: int, events: list[SessionEvent],
              session_reward: float | None) -> dict[str, Any]:
        turn = trajectory.turns[k]
        request, reply = request_text(turn), body_text(response_message(turn))
        texts = [(e.text, self._words(e.text, request, reply)) for e in events if e.text]
        said = next((t for t in reversed(texts) if t[1].label != "unclear"), None)
        rewards = [e.reward for e in events if e.reward is not None]
        words, score = None, None
        if rewards:
            mean = fmean(rewards)
            score = (mean > 0) - (mean < 0)
            agrees = said is not None and said[1].polarity == score
            call, source = Call(said[1].label if agrees else "rated", f"feedback reward {mean:+g}"), "feedback"
            words = said[0] if agrees else None
        elif said is not None:
            (words, call), source = said, "feedback"
        elif messages := next_state(trajectory, k):
            (call, words), source = classify_next_state(messages, request, reply, self.config), "next_state"
        elif texts:
            call, source = texts[-1][1], "feedback"
        elif session_reward is not None:
            return {"position": k, "class": "session_feedback", "score": session_reward, "source": "session_feedback",
                    "cue": "nothing followed: the session feedback's reward"}
        else:
            return {"position": k, "class": None, "score": 0.0, "source": None, "cue": "nothing followed: unjudged"}
        score = call.polarity if score is None else score
        entry = {"position": k, "class": call.label, "score": score, "source": source, "cue": call.cue}
        if words and (hint := hint_of(call, words, self.config)):
            entry["hint"] = hint
        return entry

    def _words(self, text: str, request: str, reply: str) -> Call:
        return read_user_text(text, request, reply, self.config)
