"""The classes the `next_state` judge sorts what followed a reply into, and a call: a class and
the cue that decided it.

Classes, by polarity: correction, complaint, retry, error, tests_failing (-1); acceptance,
thanks, moving_on, tests_passing, clean_tool_result (+1); unclear (0).
"""

from __future__ import annotations

from dataclasses import dataclass

NEGATIVE = ("correction", "complaint", "retry", "error", "tests_failing")
POSITIVE = ("acceptance", "thanks", "moving_on", "tests_passing", "clean_tool_result")
LABELS = (*NEGATIVE, *POSITIVE, "unclear")


def polarity(label: str) -> int:
    return -1 if label in NEGATIVE else 1 if label in POSITIVE else 0


@dataclass(frozen=True)
class Call:
    """A class and the cue that decided it (for people)."""

    label: str
    cue: str
    after_contrast: bool = False
    """User words whose part after a contrast ("thanks, but ...") decided."""

    @property
    def polarity(self) -> int:
        return polarity(self.label)
