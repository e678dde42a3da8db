"""Replace the personal data in a prompt with placeholders such as `<EMAIL_ADDRESS>`.

`redact(text)` finds (with the default detector, or the one given) and replaces: it returns the
new text and the findings, whose offsets refer to the original text. `replace(text, findings)` does
the replacing alone, by plain string slicing; every other character is kept as it was.

Overlapping findings (Presidio reports every type whose pattern matches: an e-mail address whose
domain is also a URL, a number that is both a driver licence and a passport) are merged so that
every character of every finding is replaced and nothing is half-replaced: each group of
overlapping findings becomes one placeholder, named for the group's most confident finding (on a
tie the longest, then the first). Findings that only touch (one ends where the next starts) stay
separate placeholders.
"""

from __future__ import annotations

from collections.abc import Iterable

from flywheel.privacy.detector import Detector, default_detector
from flywheel.privacy.findings import Finding


def placeholder(entity_type: str) -> str:
    return f"<{entity_type}>"


def replace(text: str, findings: Iterable[Finding]) -> str:
    """`text` with each group of overlapping findings replaced by one placeholder."""
    pieces, pos = [], 0
    for start, end, label in merged(findings):
        pieces.append(text[pos:start])
        pieces.append(placeholder(label))
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces)


def merged(findings: Iterable[Finding]) -> list[tuple[int, int, str]]:
    """(start, end, type) of each group of overlapping findings, in order of position."""
    groups: list[tuple[int, int, Finding]] = []  # start, end, the finding that names the group
    for f in sorted(findings, key=lambda f: (f.start, f.end)):
        if f.end <= f.start:
            continue
        if groups and f.start < groups[-1][1]:
            start, end, best = groups[-1]
            groups[-1] = (start, max(end, f.end), _better(best, f))
        else:
            groups.append((f.start, f.end, f))
    return [(start, end, best.type) for start, end, best in groups]


def _better(a: Finding, b: Finding) -> Finding:
    """The finding that names a merged group: higher score, then longer, then earlier."""
    if (b.score, b.end - b.start) > (a.score, a.end - a.start):
        return b
    return a


def redact(text: str, detector: Detector | None = None) -> tuple[str, list[Finding]]:
    """(text with placeholders, findings in the original text)."""
    findings = (detector or default_detector()).find(text)
    return (replace(text, findings) if findings else text), findings
