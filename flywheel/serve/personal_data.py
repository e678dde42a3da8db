"""A tenant's personal-data policy at the gateway (`tenants.NAME.pii`), before anything is kept.

- `redact_input`: before the prompt is built, what the detector finds in the texts of the
  request's user, system, developer and tool messages (and a completion's prompt) is replaced by
  placeholders such as `<EMAIL_ADDRESS>` (`flywheel.privacy.redact`). The model sees the redacted
  prompt, so the recorded tokens are exactly what it sampled from; the user sees a reply to the
  redacted request (one that speaks of `<EMAIL_ADDRESS>` where the address was). Assistant
  messages are left as they are: they are the model's own earlier tokens, which the next prompt
  continues exactly.
- `drop`, and `redact_input` for the reply: when the request's texts or the reply hold personal
  data, the turn is served and never recorded (nor trained); counted in `dropped`.

Nothing is ever redacted after sampling: a record's tokens and log-probabilities must stay what
the model sampled. The detectors (one per list of types) are built on first use and shared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from flywheel.bus.messages import content_parts
from flywheel.privacy import DEFAULT_ENTITIES, Detector, redact
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest

REDACTED_ROLES = ("user", "system", "developer", "tool")


class PersonalData:
    def __init__(self) -> None:
        self._detectors: dict[tuple[str, ...], Detector] = {}
        self.dropped: Counter[str] = Counter()
        """Turns not recorded, by tenant."""
        self.redacted: Counter[str] = Counter()
        """Requests whose prompt had values replaced, by tenant."""

    def detector(self, entities: tuple[str, ...] | None) -> Detector:
        key = tuple(entities) if entities is not None else tuple(DEFAULT_ENTITIES)
        if key not in self._detectors:
            self._detectors[key] = Detector(key)
        return self._detectors[key]

    def redact_request(self, body: ChatCompletionRequest | CompletionRequest, tenant: str,
                       entities: tuple[str, ...] | None) -> ChatCompletionRequest | CompletionRequest:
        """The request with the personal data in its prompt replaced by placeholders."""
        detector = self.detector(entities)
        changed = False

        def cleaned(text: str) -> str:
            nonlocal changed
            new, findings = redact(text, detector)
            changed = changed or bool(findings)
            return new

        if isinstance(body, CompletionRequest):
            if not isinstance(body.prompt, str):
                return body
            body = body.model_copy(update={"prompt": cleaned(body.prompt)})
        else:
            messages = []
            for message in body.messages:
                if message.role in REDACTED_ROLES and message.content:
                    content = (cleaned(message.content) if isinstance(message.content, str) else
                               [part.model_copy(update={"text": cleaned(part.text)}) for part in message.content])
                    message = message.model_copy(update={"content": content})
                messages.append(message)
            body = body.model_copy(update={"messages": messages})
        if changed:
            self.redacted[tenant] += 1
        return body

    def holds(self, texts: Iterable[str], entities: tuple[str, ...] | None) -> bool:
        detector = self.detector(entities)
        return any(detector.find(text) for text in texts if text)


def texts_of(messages: list[dict[str, Any]], roles: Iterable[str] | None = None) -> list[str]:
    """The texts of recorded chat messages (of `roles`, or all), each content part on its own."""
    out = []
    for message in messages:
        if roles is not None and message.get("role") not in roles:
            continue
        out.extend(content_parts(message.get("content")))
        for call in message.get("tool_calls") or []:
            out.append((call.get("function") or {}).get("arguments") or "")
    return out
