"""A session's main turns arranged by lineage: which conversation (thread) each belongs to, which
answers a retry superseded, which turns the client never used.

One session id carries more than one conversation: Claude Code sends its main agent, the
sub-agents it starts (Task tool) and its helper calls (titles, summaries) under one id; Codex
CLI compacts, the Agents SDK hands off. Clients retry (the `openai` client on timeouts and 5xx),
so the same request can be answered twice. And a turn can end without the client using it (it
went away, the request was aborted). Ordering a session's turns by `turn_index` mixes all of
that up; lineage does not.

**Parents.** A turn's parent is the earlier turn it continues from: the one whose prompt +
output its prompt ids extend (the exact-token continuation the gateway keeps), the longest such;
failing that, the one whose messages + reply its messages extend (the same conversation rendered
by a template that rewrote history: a new segment, not a new conversation). A turn with no parent
starts a conversation. Lineage does not depend on the order turns arrive in.

**Retries.** Turns with the same parent and the same prompt ids are one request sent again. The
ones a later turn continues from are kept; if none is continued, the latest (it supersedes the
others). The rest are `retry_orphans`: out of the trajectory, out of training, nobody's next
state.

**Unused turns.** A turn that ended without finishing (`finish_reason: abort`: the client went
away, the request was aborted or timed out) and that no later turn continues from is dropped and
counted. One a later turn continues from (the user pressed stop, then went on) stays as context:
its tokens are in the sequence with mask 0 (`aborted`). Turns cut at `max_tokens` are trained or
masked (`truncated`) by `collect.truncated_turns`, and counted either way.

**Threads.** A conversation follows each turn's first kept child (by arrival); a second child
(an edited, resent message) starts a branch: a thread of its own. Each thread is stitched on its
own (its own segments, so its turns' spans and next states are its own); threads are numbered
by their first turn's arrival, and all belong to the session's one trajectory, so groups, the
session's feedback and its close stay per session.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from flywheel.bus import Turn
from flywheel.bus.messages import content_text

TruncatedTurns = Literal["train", "mask"]


@dataclass
class Arrangement:
    threads: list[list[Turn]] = field(default_factory=list)
    """The kept turns, thread by thread, each in order."""
    untrained: dict[str, str] = field(default_factory=dict)
    """Turn id -> why its sampled tokens are out of the loss (`aborted`, `truncated`)."""
    retry_orphans: int = 0
    unused_turns: int = 0
    truncated_turns: int = 0
    """Turns cut at max_tokens among the kept (trained or masked)."""


def arrange(turns: list[Turn], truncated: TruncatedTurns = "train") -> Arrangement:
    """The session's main `turns` (in any order: a parent is found wherever it arrived) arranged
    by lineage."""
    ordered = sorted(turns, key=lambda t: (t.created_at, t.turn_index))
    children: dict[str | None, list[Turn]] = defaultdict(list)
    for turn in ordered:
        children[_parent(turn, ordered)].append(turn)
    out = Arrangement()
    orphans = _retry_orphans(children, out)
    dropped = orphans | _unused([t for t in ordered if t.id not in orphans], children, out)
    kept = {key: [t for t in kids if t.id not in dropped] for key, kids in children.items()}
    for root in kept.get(None, []):
        _follow(root, kept, out.threads, [])
    out.threads.sort(key=lambda thread: thread[0].created_at)
    for thread in out.threads:
        for turn in thread:
            if turn.finish_reason == "length":
                out.truncated_turns += 1
                if truncated == "mask":
                    out.untrained.setdefault(turn.id, "truncated")
    return out


def _follow(turn: Turn, kept: dict[str | None, list[Turn]], threads: list[list[Turn]], thread: list[Turn]) -> None:
    """Walk a conversation from `turn`: its first child continues `thread`, others branch."""
    if not thread:
        threads.append(thread)
    while True:
        thread.append(turn)
        kids = kept.get(turn.id, [])
        if not kids:
            return
        for branch in kids[1:]:
            _follow(branch, kept, threads, [])
        turn = kids[0]


def _retry_orphans(children: dict[str | None, list[Turn]], out: Arrangement) -> set[str]:
    orphans: set[str] = set()
    for kids in children.values():
        same_request: dict[bytes, list[Turn]] = defaultdict(list)
        for kid in kids:
            same_request[kid.prompt_ids.tobytes()].append(kid)
        for attempts in same_request.values():
            if len(attempts) < 2:
                continue
            continued = [t for t in attempts if children.get(t.id)]
            keep = continued or [max(attempts, key=lambda t: t.created_at)]  # none continued: the latest supersedes
            orphans |= {t.id for t in attempts if t not in keep}
    out.retry_orphans = len(orphans)
    return orphans


def _unused(ordered: list[Turn], children: dict[str | None, list[Turn]], out: Arrangement) -> set[str]:
    unused = set()
    for turn in ordered:
        if turn.finish_reason != "abort":
            continue
        if children.get(turn.id):
            out.untrained[turn.id] = "aborted"
        else:
            unused.add(turn.id)
    out.unused_turns = len(unused)
    return unused


def _parent(turn: Turn, turns: list[Turn]) -> str | None:
    """The turn `turn` continues from, among `turns`. A parent sampled something and its prompt is
    strictly shorter than its child's (its messages too, at the message level), so no turn is its
    own ancestor, and a retry of an answer that sampled nothing is not its child."""
    prompt = turn.prompt_ids.tobytes()
    best: Turn | None = None
    for candidate in turns:
        sequence = candidate.prompt_ids.tobytes() + candidate.output_ids.tobytes()
        if candidate.output_ids and len(sequence) <= len(prompt) and prompt.startswith(sequence) and (
                best is None or len(candidate.prompt_ids) + len(candidate.output_ids) > len(best.prompt_ids) + len(best.output_ids)):
            best = candidate
    if best is not None:
        return best.id
    for candidate in turns:
        history = [*candidate.messages, candidate.response]
        if candidate.messages and len(history) < len(turn.messages) and (
                best is None or len(candidate.messages) > len(best.messages)) and all(
                _same(a, b) for a, b in zip(history, turn.messages)):
            best = candidate
    return best.id if best is not None else None


def _same(recorded: dict[str, Any], echoed: dict[str, Any]) -> bool:
    """Whether a client's message is the one recorded, whatever shape the client echoes it in:
    the same role and text, and the same tool calls (by id, or where ids differ by name and
    arguments; a call cut at max_tokens comes back with its arguments rewrapped)."""
    if recorded.get("role") != echoed.get("role") or _text(recorded) != _text(echoed):
        return False
    calls, again = recorded.get("tool_calls") or [], echoed.get("tool_calls") or []
    return len(calls) == len(again) and all(_same_call(a, b) for a, b in zip(calls, again))


def _text(message: dict[str, Any]) -> str:
    return content_text(message.get("content")).strip()


def _same_call(recorded: dict[str, Any], echoed: dict[str, Any]) -> bool:
    first, second = recorded.get("function", {}), echoed.get("function", {})
    if first.get("name") != second.get("name"):
        return False
    same_id = recorded.get("id") is not None and recorded.get("id") == echoed.get("id")
    return same_id or _canonical(first.get("arguments")) == _canonical(second.get("arguments"))


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
