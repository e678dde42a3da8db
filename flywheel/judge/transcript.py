"""A trajectory's conversation as the judges read it: the task context, what each turn was asked,
the turn's reply, what followed it, and a plain-text rendering of messages.

Messages are OpenAI chat messages as the model was asked them (`content` a string, a list of
parts, or None; assistant `tool_calls`; tool results). Only text is rendered: image parts and
other non-text parts become a placeholder naming their type.
"""

from __future__ import annotations

import json
from typing import Any

from flywheel.bus import Trajectory, Turn

Message = dict[str, Any]


def content_text(content: Any) -> str:
    """A message's `content` as text: a string as is, text parts joined, other parts named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type", "unknown") if isinstance(part, dict) else type(part).__name__
                parts.append(f"[{kind} part]")
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False, default=str)


def body_text(message: Message) -> str:
    """A message's text without its role: the content, then one line per tool call."""
    lines = [content_text(message.get("content", message.get("text")))]
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        lines.append(f"tool call {call.get('id', '?')}: {function.get('name', '?')}({function.get('arguments', '')})")
    return "\n".join(lines).strip()


def message_text(message: Message) -> str:
    """One message as `role: text` (a tool result says which call it answers)."""
    role = str(message.get("role", "unknown"))
    if role == "tool" and message.get("tool_call_id"):
        role = f"tool (result of call {message['tool_call_id']})"
    return f"{role}: {body_text(message)}"


def messages_text(messages: list[Message]) -> str:
    return "\n\n".join(message_text(m) for m in messages)


def response_message(turn: Turn) -> Message:
    """The turn's reply as an assistant message (a text completion's `{"text"}` included)."""
    if "role" in turn.response:
        return turn.response
    return {"role": "assistant", "content": turn.response.get("text", "")}


def conversation(turn: Turn) -> list[Message]:
    """The conversation up to and including the turn's reply."""
    history = list(turn.messages) if turn.messages else [{"role": "user", "content": turn.prompt or ""}]
    return [*history, response_message(turn)]


def task_context(trajectory: Trajectory, position: int = 0) -> str:
    """The task of the turn at `position`: the task id, and the system message and first user
    message of that turn's own conversation (a sub-agent's is not the main agent's)."""
    threads = trajectory.threads or [0] * len(trajectory.turns)
    thread = threads[position] if position < len(threads) else 0
    first = next((turn for turn, t in zip(trajectory.turns, threads) if t == thread), None)
    lines = [f"task id: {trajectory.task_id}"] if trajectory.task_id else []
    if first is not None and not first.messages:
        lines.append(f"prompt: {first.prompt or ''}")
    elif first is not None:
        system = [m for m in first.messages[:1] if m.get("role") in ("system", "developer")]
        user = next((m for m in first.messages if m.get("role") == "user"), None)
        lines += [message_text(m) for m in [*system, *([user] if user else [])]]
    return "\n\n".join(lines)


def request(turn: Turn) -> list[Message]:
    """What the turn answered: its request's messages after the last assistant message."""
    if not turn.messages:
        return [{"role": "user", "content": turn.prompt or ""}]
    last_assistant = max((i for i, m in enumerate(turn.messages) if m.get("role") == "assistant"), default=-1)
    return list(turn.messages[last_assistant + 1:])


def next_state(trajectory: Trajectory, position: int) -> list[Message]:
    """The messages that followed the turn at `position` in its own conversation (empty for its
    conversation's last turn)."""
    return list(trajectory.next_states[position]) if position < len(trajectory.next_states) else []


def feedback_about(trajectory: Trajectory, position: int) -> list[Message]:
    """Feedback aimed at the turn at `position` (by its interaction id, or its turn index in the
    first conversation), as messages of role `feedback`: its text and reward."""
    turn = trajectory.turns[position]
    threads = trajectory.threads or [0] * len(trajectory.turns)
    out = []
    for event in trajectory.feedback:
        about = event.interaction_id == turn.id if event.interaction_id is not None else (
            event.turn_index is not None and event.turn_index == turn.turn_index and threads[position] == 0)
        if about and (event.text or event.reward is not None):
            reward = f" (reward {event.reward:g})" if event.reward is not None else ""
            out.append({"role": f"feedback from {event.source}", "content": f"{event.text or ''}{reward}".strip()})
    return out
