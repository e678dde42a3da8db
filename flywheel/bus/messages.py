"""Recorded chat messages (`Turn.messages`, as the model was asked them): their text."""

from __future__ import annotations

from typing import Any


def content_parts(content: Any) -> list[str]:
    """A recorded chat message's `content` as its texts: a string as the one, else its text parts
    each on its own (other parts, images and the like, left out)."""
    if isinstance(content, list):
        return [part.get("text") or "" for part in content if isinstance(part, dict)]
    return [content or ""]


def content_text(content: Any) -> str:
    """A recorded chat message's `content` as one text, its text parts joined as the model reads
    them (a search for personal data reads `content_parts` instead: joined, a value at the end of
    one part runs into the next)."""
    return "".join(content_parts(content))
