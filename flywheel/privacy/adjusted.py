"""Four of Presidio's recognizers adjusted for Flywheel: offline, faster, fewer false alarms.

- `OfflineEmail`: Presidio's e-mail recognizer checks the domain with the module-level
  `tldextract.extract`, which downloads the public suffix list from publicsuffix.org on first use
  (with no timeout) unless a copy is cached on disk, and reads its URLs from the environment only
  when tldextract is first imported. Here the domain is checked against the list bundled inside
  the tldextract package, with no URLs and no disk cache: nothing is fetched or written.
- `Phone`: Presidio runs python-phonenumbers' matcher over the whole text once per region (eight
  by default): 80% of the detector's time on chat-sized texts. Now a finding must hold a chain
  of at least `MIN_DIGITS` digits (German numbering accepts four-digit numbers such as "1640",
  which made counts, years and decimals phone numbers), so the matcher gets the text with every
  character far from such a chain blanked out (`mask_for_phones`, same offsets), and nothing at
  all when there is none. Chains it would reject or the detector would drop are not shown to it
  either: a log time stamp ("2024-01-09 16" before ":31"), and bare digits with no phone context
  word before them. Canada is left out of the regions (it shares the US plan). A test checks
  that the detector's phone findings are the same as with Presidio's recognizer on the whole
  text. Numbers must also be grouped as their region writes them (phonenumbers'
  STRICT_GROUPING: "212 555 0198" and "+44 20 7946 0958" pass, decimals such as
  "0.220 / 0.214 / 0.163" do not), and an opening bracket the number does not close ("[" in
  JSON) is left out of the finding.
- `InPan`: the weakest of Presidio's Indian PAN patterns ("PAN (Low)") looks ahead with `.*?`,
  compiled with DOTALL, through the rest of the text from every word boundary: quadratic (4.3 s
  on 50,000 characters of prose), and it accepts any ten-character word when a letter and four
  digits occur anywhere after it. Its lookaheads now stay within the ten characters it matches.
- `Ip`: loopback and unspecified addresses (127.0.0.1, 0.0.0.0, ::1, ::) identify no one and are
  everywhere in code and logs; they are not reported.
"""

from __future__ import annotations

import functools
import ipaddress
import re

import tldextract
from presidio_analyzer import Pattern
from presidio_analyzer.predefined_recognizers import (
    EmailRecognizer,
    InPanRecognizer,
    IpRecognizer,
    PhoneRecognizer,
)

from flywheel.privacy.context import WholeWordContext

MIN_DIGITS = 7
try:  # what phonenumbers allows between the digit groups of a candidate: "[...]{0,4}"
    from phonenumbers.phonenumbermatcher import _PUNCTUATION as _SEPARATORS
except ImportError:  # a superset of it
    _SEPARATORS = r"[^\d\n]{0,4}"
try:  # the date and hour of a time stamp, and the ":mm" after them, which the matcher rejects
    from phonenumbers.phonenumbermatcher import _TIME_STAMPS, _TIME_STAMPS_SUFFIX
except ImportError:
    _TIME_STAMPS = _TIME_STAMPS_SUFFIX = None
# A chain of at least MIN_DIGITS digits as phonenumbers' candidates chain them.
_PHONE_RUN = re.compile(rf"\d(?:{_SEPARATORS}\d){{{MIN_DIGITS - 1},}}")
_PLUS = "+\uff0b"
_CLOSING = {"(": ")", "[": "]", "\uff08": "\uff09", "\uff3b": "\uff3d"}
_MARGIN = 24
_NOT_NEWLINE = re.compile(r"[^\n]")
STRICT_GROUPING = 2  # phonenumbers.Leniency.STRICT_GROUPING
# Presidio's default regions but Canada, which shares the US numbering plan (+1): every number
# the matcher accepts for CA it accepts for US, at the same span.
REGIONS = ("US", "GB", "DE", "FR", "IL", "IN", "BR")


@functools.cache
def offline_tld_extractor() -> tldextract.TLDExtract:
    """A TLDExtract that reads only the public suffix list bundled with the package."""
    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None, fallback_to_snapshot=True)


class OfflineEmail(EmailRecognizer):
    """Presidio's e-mail pattern; the domain must end in a known public suffix (bundled list)."""

    def validate_result(self, pattern_text: str) -> bool:
        return offline_tld_extractor()(pattern_text).fqdn != ""


class Phone(PhoneRecognizer):
    """Presidio's phone recognizer, run only near chains of MIN_DIGITS digits."""

    def __init__(self, **kwargs):
        kwargs.setdefault("leniency", STRICT_GROUPING)
        kwargs.setdefault("supported_regions", REGIONS)
        super().__init__(**kwargs)
        self._enhancer = WholeWordContext()

    def analyze(self, text, entities, nlp_artifacts=None):
        runs = [m for m in _PHONE_RUN.finditer(text)
                if not (_time_stamp(text, m) or self._bare_without_context(text, m, nlp_artifacts))]
        masked = mask_for_phones(text, runs)
        if masked is None:
            return []
        results = super().analyze(masked, entities, nlp_artifacts)
        for r in results:
            r.start = trim_opening_bracket(text, r.start, r.end)
        return [r for r in results if _PHONE_RUN.search(text, r.start, r.end)]

    def _bare_without_context(self, text: str, run: re.Match, nlp_artifacts) -> bool:
        """A plain run of digits (no "+" just before it) with no phone context word in the five
        words before it: the detector drops whatever is found there (`flywheel.privacy.detector`),
        so the matcher need not look. (One thing is lost: such a number followed by an extension,
        "2125550198 ext. 12", which the detector would have kept as not bare.)"""
        if not run.group().isdigit() or any(c in _PLUS for c in text[max(0, run.start() - 5):run.start()]):
            return False
        if nlp_artifacts is None:
            return True
        words = self._enhancer._extract_surrounding_words(nlp_artifacts, run.group(), run.start())
        return not self._enhancer._find_supportive_word_in_context(words, self.context)


def _time_stamp(text: str, run: re.Match) -> bool:
    """A chain such as "2024-01-09 16" followed by ":31": the matcher rejects that candidate
    outright (it is the whole candidate: ":" can neither continue a number nor start an
    extension), and the shorter ones around it cannot make MIN_DIGITS digits."""
    if _TIME_STAMPS is None or not _TIME_STAMPS.search(run.group()):
        return False
    return _TIME_STAMPS_SUFFIX.match(text, run.end()) is not None


def trim_opening_bracket(text: str, start: int, end: int) -> int:
    """`start`, moved past an opening bracket that the number does not close: phonenumbers takes
    the "[" of `[2125550198]` (JSON) into the number, and redacting it would break the list."""
    opening = text[start] if start < end else ""
    if opening in _CLOSING and _CLOSING[opening] not in text[start:end]:
        start += 1
        while start < end and not (text[start].isdigit() or text[start] in _PLUS):
            start += 1  # and the punctuation between it and the number
    return start


def mask_for_phones(text: str, runs: list[re.Match] | None = None) -> str | None:
    """`text` with every character far from the given chains of digits (by default, every chain
    of MIN_DIGITS digits) replaced by a space, line breaks kept; None if there are none.

    A chain (`_PHONE_RUN`) joins digits separated by what phonenumbers allows between the digit
    groups of a candidate, so every number of MIN_DIGITS digits lies in one. `_MARGIN`
    characters either side are kept: the matcher looks at the characters around a candidate, and
    at an extension such as " ext. 12". Offsets are unchanged, so findings in the masked text are
    findings in `text`.
    """
    spans: list[list[int]] = []
    for hit in _PHONE_RUN.finditer(text) if runs is None else runs:
        start, end = max(0, hit.start() - _MARGIN), min(len(text), hit.end() + _MARGIN)
        if spans and start <= spans[-1][1]:
            spans[-1][1] = end
        else:
            spans.append([start, end])
    if not spans:
        return None
    if spans == [[0, len(text)]]:
        return text
    pieces, pos = [], 0
    for start, end in spans:
        pieces.append(_blank(text[pos:start]))
        pieces.append(text[start:end])
        pos = end
    pieces.append(_blank(text[pos:]))
    return "".join(pieces)


def _blank(piece: str) -> str:
    return _NOT_NEWLINE.sub(" ", piece)


class Ip(IpRecognizer):
    """Presidio's IPv4/IPv6 recognizer without loopback and unspecified addresses."""

    def invalidate_result(self, pattern_text: str) -> bool:
        try:
            address = ipaddress.ip_interface(pattern_text).ip
        except ValueError:
            return True
        return address.is_loopback or address.is_unspecified


class InPan(InPanRecognizer):
    """Presidio's Indian PAN recognizer with its weakest pattern confined to the word it matches."""

    PATTERNS = [p for p in InPanRecognizer.PATTERNS if p.name != "PAN (Low)"] + [
        Pattern("PAN (Low)", r"\b(?=[\w@#$%^?~-]{0,9}[a-zA-Z])(?=[\w@#$%^?~-]{0,6}[0-9]{4})[\w@#$%^?~-]{10}\b", 0.01),
    ]


# Presidio class name -> its replacement here (flywheel.privacy.engine.create_recognizer)
REPLACES = {"EmailRecognizer": OfflineEmail, "PhoneRecognizer": Phone, "IpRecognizer": Ip, "InPanRecognizer": InPan}
