"""Recorded chat messages (`Turn.messages`, as the gateway received them): their text."""

from __future__ import annotations

from typing import Any


def content_text(content: Any) -> str:
    """A recorded chat message's `content` as text: a string as is, its text parts joined (other
    parts, images and the like, left out)."""
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return content or ""
