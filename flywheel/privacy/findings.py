"""One piece of personal data found in a text: its type, where it is, and how sure the detector is.

`start` and `end` are Python string offsets (code points, end exclusive): `text[f.start:f.end]` is
the value. `score` is Presidio's confidence in [0, 1]: a pattern's base score, raised by context
words near the match ("ssn", "passport", "phone"...) or set to 1.0 by a passing checksum (credit
cards, IBANs, crypto addresses).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Finding:
    type: str  # Presidio entity type, e.g. "EMAIL_ADDRESS"
    start: int
    end: int
    score: float

    def value(self, text: str) -> str:
        """The detected value in the text it was found in."""
        return text[self.start:self.end]
