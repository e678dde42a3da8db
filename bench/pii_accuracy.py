"""PII detection accuracy on a labelled set its implementer never read: what `flywheel.privacy`
catches, what it misses, and how often it raises a false alarm.

What it measures
    `tests/data/pii_labelled.jsonl` (written from a brief by someone who did not see the detector;
    `tests/data/pii_labelled.md` says how): texts such as people type to an assistant, each with
    its personal data labelled as exact substrings and a type, a third of them with none.

    - per labelled type: recall, an entity counted as caught when a finding overlaps its span
      (any type: the gateway's policies drop or redact whatever is found), and, of those, how
      many the finding also named with the matching type;
    - per text: a text holding personal data is caught when the detector finds anything in it
      (what `pii: drop` acts on), and a text holding none is a false alarm when it finds
      anything; both by language;
    - the misses, listed plainly by type (with the type's examples when `--show-misses`).

    The detector runs with its default entity types (`DEFAULT_ENTITIES`): names, addresses and
    dates of birth need a trained model and are expected to be missed.

How to run (from the repository root)
    .venv/bin/python bench/pii_accuracy.py [--show-misses]
    Writes bench/results/pii_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import ROOT, table, write_result  # noqa: E402
from flywheel.privacy import DEFAULT_ENTITIES, Detector  # noqa: E402

DATA = ROOT / "tests" / "data" / "pii_labelled.jsonl"
MATCHING = {
    "EMAIL_ADDRESS": {"EMAIL_ADDRESS"}, "PHONE_NUMBER": {"PHONE_NUMBER"}, "CREDIT_CARD": {"CREDIT_CARD"},
    "IBAN_CODE": {"IBAN_CODE"}, "IP_ADDRESS": {"IP_ADDRESS"}, "URL": {"URL"}, "US_SSN": {"US_SSN"},
    "CRYPTO": {"CRYPTO"}, "PASSPORT": {"US_PASSPORT", "UK_PASSPORT", "IT_PASSPORT", "KR_PASSPORT", "DE_PASSPORT"},
}
"""The detector's types that name a labelled type; the others (PERSON, LOCATION, DATE_OF_BIRTH,
OTHER_ID) are counted as caught by any finding, with no type to match."""


def spans(text: str, value: str) -> list[tuple[int, int]]:
    out, start = [], text.find(value)
    while start >= 0:
        out.append((start, start + len(value)))
        start = text.find(value, start + 1)
    return out


def evaluate(examples: list[dict], detector: Detector) -> dict:
    caught, typed, total = Counter(), Counter(), Counter()
    misses: dict[str, list[str]] = defaultdict(list)
    texts = Counter()
    for example in examples:
        text = example["text"]
        findings = detector.find(text)
        language = (example.get("note") or "lang=en").split()[0].removeprefix("lang=").rstrip(";,")
        has_pii = bool(example["entities"])
        texts[(has_pii, language, "all")] += 1
        if findings:
            texts[(has_pii, language, "flagged")] += 1
        used: Counter = Counter()
        for entity in example["entities"]:
            kind, value = entity["type"], entity["value"]
            total[kind] += 1
            occurrences = spans(text, value)
            start, end = occurrences[min(used[value], len(occurrences) - 1)]
            used[value] += 1
            overlapping = [f for f in findings if f.start < end and start < f.end]
            if overlapping:
                caught[kind] += 1
                if kind not in MATCHING or any(f.type in MATCHING[kind] for f in overlapping):
                    typed[kind] += 1
            else:
                misses[kind].append(value)
    by_type = {kind: {"labelled": total[kind], "caught": caught[kind], "recall": caught[kind] / total[kind],
                      "named_right": typed[kind]} for kind in sorted(total)}
    languages = sorted({language for _, language, _ in texts})

    def share(has_pii: bool, language: str | None) -> tuple[int, int]:
        keys = [language] if language else languages
        return (sum(texts[(has_pii, lang, "flagged")] for lang in keys), sum(texts[(has_pii, lang, "all")] for lang in keys))

    per_text = {lang or "all": {"pii_texts_caught": share(True, lang), "clean_texts_flagged": share(False, lang)}
                for lang in [None, *languages]}
    return {"by_type": by_type, "per_text": per_text, "misses": {k: v for k, v in sorted(misses.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show-misses", action="store_true", help="print each missed value, by type")
    args = parser.parse_args()
    examples = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    result = evaluate(examples, Detector(DEFAULT_ENTITIES))
    print(table(["type", "labelled", "caught", "recall", "named right"],
                [[kind, r["labelled"], r["caught"], f"{r['recall']:.0%}", r["named_right"]]
                 for kind, r in result["by_type"].items()]))
    print(table(["texts", "with personal data: caught", "without: false alarms"],
                [[lang, f"{c[0]}/{c[1]} ({c[0] / max(c[1], 1):.0%})", f"{f[0]}/{f[1]} ({f[0] / max(f[1], 1):.0%})"]
                 for lang, r in result["per_text"].items() for c, f in [(r["pii_texts_caught"], r["clean_texts_flagged"])]]))
    if args.show_misses:
        for kind, values in result["misses"].items():
            print(f"{kind}: {values}")
    write_result("pii_accuracy", {"examples": len(examples), "entities": sorted(DEFAULT_ENTITIES), **result})


if __name__ == "__main__":
    main()
