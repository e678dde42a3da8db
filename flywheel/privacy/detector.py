"""Find personal data in text: `Detector(entities).find(text) -> list[Finding]`.

A detector is a list of entity types (names from `flywheel.privacy.entities`; by default
`DEFAULT_ENTITIES`) and a score threshold. `find` asks the process's one Presidio engine
(`flywheel.privacy.engine`, built on the first call) for those types only, so the recognizers of
other types do not run, and returns the findings at or above the threshold sorted by position.
Overlapping findings of different types are all returned (an e-mail address may also hold an
IP address); the redactor resolves them.

The threshold, 0.4 by default, is where Presidio's context words matter: weak patterns (a bare
9-digit number as a US passport, 0.05; 8-17 digits as a US bank account; a driver-licence
shape) reach it only when a context word ("passport", "account", "license"...) stands within the
five words before them, which adds 0.35 and lifts the score to at least 0.4. Strong patterns
(e-mail, IP address, a formatted SSN) pass on their own, and checksums (credit card, IBAN,
crypto address) raise a match to 1.0.

Results are then kept or dropped by the rules of `flywheel.privacy.rules`: not part of a longer
word; a bare run of digits, or a short id with one check digit, only with a context word.

Chat requests carry the whole conversation, so the same message is checked again on every turn:
each detector remembers the findings of its last `cache_size` distinct texts (keyed by a 16-byte
BLAKE2b digest, so no text is kept), and a repeated message costs a hash. Detectors are
immutable and thread-safe; `find` at module level uses a default one.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

from flywheel.lru import LRU
from flywheel.privacy.engine import analyzer
from flywheel.privacy.entities import DEFAULT_ENTITIES, LANGUAGE, check_entities
from flywheel.privacy.findings import Finding
from flywheel.privacy.rules import keep

DEFAULT_SCORE_THRESHOLD = 0.4
DEFAULT_CACHE_SIZE = 4096


class Detector:
    """Finds the given entity types in texts; see the module docstring."""

    languages = (LANGUAGE,)  # Presidio's language key; the patterns find values in any language

    def __init__(self, entities: Iterable[str] = DEFAULT_ENTITIES,
                 score_threshold: float = DEFAULT_SCORE_THRESHOLD, cache_size: int = DEFAULT_CACHE_SIZE):
        self.entities = check_entities(entities)
        self.score_threshold = score_threshold
        self._cache: LRU[bytes, tuple[Finding, ...]] = LRU(cache_size)
        self._cache_lock = threading.Lock()

    def find(self, text: str) -> list[Finding]:
        """The personal data in `text`, sorted by start, longest first."""
        if not text or not self.entities:
            return []
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._cache_lock:
            cached = self._cache.get(key)
        if cached is not None:
            return list(cached)
        found = self._analyze(text)
        with self._cache_lock:
            self._cache[key] = tuple(found)
        return found

    def _analyze(self, text: str) -> list[Finding]:
        results = analyzer().analyze(text=text, language=LANGUAGE, entities=list(self.entities),
                                     score_threshold=self.score_threshold, return_decision_process=True)
        found = [Finding(r.entity_type, r.start, r.end, round(float(r.score), 4)) for r in results
                 if keep(text, r)]
        found.sort(key=lambda f: (f.start, -f.end, f.type))
        return found

    def __repr__(self) -> str:
        return f"Detector({len(self.entities)} entity types, score_threshold={self.score_threshold})"


_default: Detector | None = None


def default_detector() -> Detector:
    """The detector of `DEFAULT_ENTITIES` at the default threshold, made on first use."""
    global _default
    if _default is None:
        _default = Detector()
    return _default


def find(text: str) -> list[Finding]:
    """`default_detector().find(text)`."""
    return default_detector().find(text)
