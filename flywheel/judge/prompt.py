"""The `llm` judge's request for one turn: the configured templates filled in, conversation text
fenced.

`render(trajectory, position)` returns the chat messages to send (a system message: the
configured `system_prompt` plus the fence notice; a user message: the configured `user_prompt`)
and the `Fence` it used. Templates are `string.Template` text (`$response`, `${context}`; `$$`
is a literal `$`); `flywheel.config.schema` checks their placeholders when the configuration loads.
Conversation text (agent-controlled) only ever enters the prompt inside a fenced block
(`flywheel/judge_client/fence.py`), and only through the user message:

    $context     the task: its id, the system message and first user message of the session
    $request     what the assistant was asked at this turn (the messages since its last reply)
    $response    the turn's reply, the thing being judged
    $next_state  what followed the reply in its conversation: the user's answer, tool results (all
                 of them), and any feedback about the turn

and the judge's own values: $turn_number (1-based), $num_turns, $score_min, $score_max.
"""

from __future__ import annotations

from string import Template

from flywheel.bus import Trajectory
from flywheel.config.judge import LLMJudgeConfig
from flywheel.judge import transcript
from flywheel.judge_client.fence import Fence, clip

NOTHING_FOLLOWED = "(nothing: the conversation ended after this reply)"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class PromptBuilder:
    def __init__(self, config: LLMJudgeConfig):
        self.config = config
        system, user = config.prompts
        self.system, self.user = Template(system), Template(user)

    def render(self, trajectory: Trajectory, position: int) -> tuple[list[dict[str, str]], Fence]:
        """The messages judging `trajectory.turns[position]`, with a fresh fence."""
        fence = Fence()
        turn = trajectory.turns[position]
        following = transcript.next_state(trajectory, position) + transcript.feedback_about(trajectory, position)
        texts = {
            "context": transcript.task_context(trajectory, position),
            "request": transcript.messages_text(transcript.request(turn)),
            "response": transcript.body_text(turn.response),
            "next_state": transcript.messages_text(following) if following else NOTHING_FOLLOWED,
        }
        values = {name: fence.wrap(name, clip(text, self.config.max_field_chars)) for name, text in texts.items()}
        values |= {
            "turn_number": str(position + 1),
            "num_turns": str(len(trajectory.turns)),
            "score_min": _number(self.config.scale[0]),
            "score_max": _number(self.config.scale[1]),
        }
        system = f"{self.system.substitute(values)}\n\n{fence.notice()}"
        return [{"role": "system", "content": system}, {"role": "user", "content": self.user.substitute(values)}], fence

