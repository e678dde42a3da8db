"""Which of Presidio's results the detector keeps, beyond its score threshold.

Agent traffic (code, logs, JSON, hashes, ids) is full of strings that Presidio's patterns and
checksums accept by chance; three rules, each measured on random strings of that kind placed in
a sentence with no context word, remove most of them:

- Not part of a longer word: a finding with an ASCII letter or digit right before or after it is
  a piece of something else. Some of Presidio's patterns have no word boundaries: the US DEA
  number (MEDICAL_LICENSE) matched inside 1.5% of random 40-digit hex hashes (git commits) and
  3.7% of SHA-256 digests, the Finnish and Polish ids inside longer numbers. Other scripts'
  letters do not count, so values written without spaces in Chinese or Japanese text are kept.
- Bare digits need a context word: a plain run of digits with no separators is reported only
  with a context word near it ("phone", "NHS", "account"... within the five words before), except
  as a credit card number. Ids, counts and Unix timestamps are such runs, and checks pass by
  chance: 89% of random 10-digit numbers (and 80% of Unix timestamps) were valid phone numbers,
  8% of them a UK NHS number, 12% of 11-digit numbers a German tax id and 10% a Nigerian NIN, 8%
  of 12-digit ones an Aadhaar number. "NHS number 9434765919", "phone: 2125550198" and
  "943 476 5919" are still found.
- Short ids with one check character need a context word: a German id card, passport or health
  insurance number, or a US DEA number, is a letter or two and eight or nine characters that
  pass a single check digit, which 1.5%, 0.4%, 0.6% and 0.8% of ticket- or order-like ids
  ("T92844898", "M26216753") did.

"Context word" is the recognizer's own list, matched as whole words (`flywheel.privacy.context`).
"""

from __future__ import annotations

BARE_DIGITS_OK = frozenset({"CREDIT_CARD"})
NEED_CONTEXT = frozenset({"DE_ID_CARD", "DE_PASSPORT", "DE_HEALTH_INSURANCE", "MEDICAL_LICENSE"})


def keep(text: str, result) -> bool:
    """Whether the detector reports `result` (a Presidio RecognizerResult for `text`, with its
    analysis explanation)."""
    if _glued(text, result.start, result.end):
        return False
    if result.entity_type in NEED_CONTEXT:
        return _has_context(result)
    if result.entity_type not in BARE_DIGITS_OK and text[result.start:result.end].isdigit():
        return _has_context(result)
    return True


def _glued(text: str, start: int, end: int) -> bool:
    return (start > 0 and _ascii_alnum(text[start - 1])) or (end < len(text) and _ascii_alnum(text[end]))


def _ascii_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _has_context(result) -> bool:
    explanation = result.analysis_explanation
    return bool(explanation and explanation.supportive_context_word)
