"""`flywheel.privacy`: personal data found and replaced with real Presidio, offline.

Every supported entity type is found at its exact span in examples written here; ordinary text
(versions, code, arithmetic, logs, ids) gives no finding; redaction replaces exactly the values
and keeps every other character; one engine serves the process and its threads; the adjusted
recognizers find what Presidio's own do. Offline, in a fresh process: test_privacy_offline.py.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from flywheel import privacy
from flywheel.privacy import (
    DEFAULT_ENTITIES,
    OPTIONAL_ENTITIES,
    SUPPORTED_ENTITIES,
    Detector,
    Finding,
    find,
    redact,
    replace,
)

# (entity type, text, the value in it) — the value's span is where it first occurs in the text
EXAMPLES = [
    ("EMAIL_ADDRESS", "Please write to jane.doe@example.com before Friday.", "jane.doe@example.com"),
    ("EMAIL_ADDRESS", "cc: o'brien+billing@mail.example.co.uk", "o'brien+billing@mail.example.co.uk"),
    ("EMAIL_ADDRESS", "Mail an müller@beispiel.de, danke", "müller@beispiel.de"),
    ("PHONE_NUMBER", "You can reach me on +44 20 7946 0958 after six.", "+44 20 7946 0958"),
    ("PHONE_NUMBER", "Office: (212) 555-0198", "(212) 555-0198"),
    ("PHONE_NUMBER", "my mobile number is 212-555-0198", "212-555-0198"),
    ("PHONE_NUMBER", "Ruf mich an: +49 30 12345678", "+49 30 12345678"),
    ("PHONE_NUMBER", "my phone is 2125550198", "2125550198"),
    ("CREDIT_CARD", "Charge it to 4111 1111 1111 1111 please", "4111 1111 1111 1111"),
    ("CREDIT_CARD", "card=5555555555554444;", "5555555555554444"),
    ("CREDIT_CARD", "amex 3782-822463-10005", "3782-822463-10005"),
    ("IBAN_CODE", "Pay to DE89 3704 0044 0532 0130 00 by Monday", "DE89 3704 0044 0532 0130 00"),
    ("IBAN_CODE", "IBAN: GB82WEST12345698765432", "GB82WEST12345698765432"),
    ("IP_ADDRESS", "ssh admin@203.0.113.42 failed", "203.0.113.42"),
    ("IP_ADDRESS", "client 2001:db8:85a3::8a2e:370:7334 connected", "2001:db8:85a3::8a2e:370:7334"),
    ("IP_ADDRESS", "my home router is 192.168.1.20", "192.168.1.20"),
    ("CRYPTO", "send BTC to 1BoatSLRHtKNngkdXEeobR76b53LETtpyT thanks", "1BoatSLRHtKNngkdXEeobR76b53LETtpyT"),
    ("CRYPTO", "wallet bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq", "bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq"),
    ("US_SSN", "My SSN is 536-22-8731.", "536-22-8731"),
    ("US_SSN", "social security number 536 22 8731", "536 22 8731"),
    ("US_ITIN", "my ITIN is 912-70-1234", "912-70-1234"),
    ("US_PASSPORT", "US passport number 912803456", "912803456"),
    ("US_DRIVER_LICENSE", "driver license D1234567", "D1234567"),
    ("US_BANK_NUMBER", "bank account 123456789012", "123456789012"),
    ("MEDICAL_LICENSE", "DEA certificate BJ6125341", "BJ6125341"),
    ("UK_NHS", "NHS number 943 476 5919", "943 476 5919"),
    ("UK_NHS", "NHS number 9434765919", "9434765919"),
    ("UK_NINO", "national insurance number AB 12 34 56 C", "AB 12 34 56 C"),
    ("UK_PASSPORT", "UK passport number AB1234567", "AB1234567"),
    ("UK_DRIVING_LICENCE", "driving licence MORGA657054SM9IJ", "MORGA657054SM9IJ"),
    ("CA_SIN", "SIN 130 692 502", "130 692 502"),
    ("ES_NIF", "DNI 12345678Z", "12345678Z"),
    ("ES_NIE", "NIE X1234567L", "X1234567L"),
    ("IT_FISCAL_CODE", "codice fiscale RSSMRA85T10A562S", "RSSMRA85T10A562S"),
    ("IT_IDENTITY_CARD", "carta d'identità CA00000AA", "CA00000AA"),
    ("IT_PASSPORT", "passaporto YA1234567", "YA1234567"),
    ("IT_DRIVER_LICENSE", "patente di guida U1H9XY123Q", "U1H9XY123Q"),
    ("PL_PESEL", "PESEL 44051401359", "44051401359"),
    ("DE_TAX_ID", "Steuer-ID 86095742719", "86095742719"),
    ("DE_ID_CARD", "Personalausweis T22000129", "T22000129"),
    ("DE_PASSPORT", "Reisepass CW8R3C370", "CW8R3C370"),
    ("DE_SOCIAL_SECURITY", "Sozialversicherungsnummer 65170839J003", "65170839J003"),
    ("DE_HEALTH_INSURANCE", "Krankenversicherungsnummer A123456780", "A123456780"),
    ("FI_PERSONAL_IDENTITY_CODE", "henkilötunnus 131052-308T", "131052-308T"),
    ("SE_PERSONNUMMER", "personnummer 811218-9876", "811218-9876"),
    ("IN_AADHAAR", "aadhaar 2345 6789 0124", "2345 6789 0124"),
    ("IN_PAN", "PAN ABCPD1234E", "ABCPD1234E"),
    ("IN_PASSPORT", "indian passport A1234567", "A1234567"),
    ("IN_VOTER", "voter id ABC1234567", "ABC1234567"),
    ("SG_NRIC_FIN", "NRIC S1234567D", "S1234567D"),
    ("AU_TFN", "tax file number 123 456 782", "123 456 782"),
    ("AU_MEDICARE", "medicare 2123 45670 1", "2123 45670 1"),
    ("KR_RRN", "RRN 900101-1234568", "900101-1234568"),
    ("KR_PASSPORT", "Korean passport M12345678", "M12345678"),
    ("TH_TNIN", "Thai ID Number 1101700230708", "1101700230708"),
    ("TR_NATIONAL_ID", "TC kimlik no 10000000146", "10000000146"),
    ("NG_NIN", "NIN 79597857351", "79597857351"),
    ("ZA_ID_NUMBER", "ID number 8001015009087", "8001015009087"),
    ("PH_UMID", "UMID 0028-1234567-8", "0028-1234567-8"),
    # optional types (asked for by name)
    ("URL", "see https://example.com/a?b=1 for details", "https://example.com/a?b=1"),
    ("DATE_TIME", "born on 12/01/1985", "12/01/1985"),
    ("UUID", "request 123e4567-e89b-12d3-a456-426614174000 failed", "123e4567-e89b-12d3-a456-426614174000"),
    ("MAC_ADDRESS", "mac 00:1A:2B:3C:4D:5E", "00:1A:2B:3C:4D:5E"),
    ("UK_POSTCODE", "postcode SW1A 1AA", "SW1A 1AA"),
    ("CA_POSTAL_CODE", "postal code K1A 0B1", "K1A 0B1"),
    ("UK_VEHICLE_REGISTRATION", "vehicle registration AB51 ABC", "AB51 ABC"),
    ("IN_VEHICLE_REGISTRATION", "vehicle registration MH12AB1234", "MH12AB1234"),
    ("AU_ABN", "ABN 51 824 753 556", "51 824 753 556"),
    ("AU_ACN", "ACN 004 085 616", "004 085 616"),
    ("SG_UEN", "UEN 20791882A", "20791882A"),
]

# Text with no personal data in it, of the kinds an agent's traffic is made of.
ORDINARY = [
    "Upgrade to python 3.11.7 and torch 2.13.0; transformers>=5.0 is required (we tested 5.24.0).",
    "pip install presidio-analyzer==2.2.366 spacy==3.8.18",
    "12 * 34 = 408, 1234 + 5678 = 6912, and 2**20 = 1048576; 355/113 = 3.14159292",
    "def area(r):\n    return 3.14159 * r ** 2\n\nfor i in range(10, 20):\n    print(i, area(i))\n",
    "x = 0x1F3A; mask = 0b1010_1010; big = 123_456_789",
    "2024-05-17T10:32:11.512Z INFO worker-3 step=1200 loss=2.3412 tokens/s=15320 mem=11.2GB",
    ('Traceback (most recent call last):\n  File "/home/app/train.py", line 214, in <module>\n'
     "RuntimeError: CUDA error: out of memory (tried to allocate 2.00 GiB; 1.53 GiB free)"),
    "Server listening on http://127.0.0.1:8000 and 0.0.0.0:9090; also [::1]:8080 and localhost:3000",
    "commit 3f2a9c81b7e4d5f60123456789abcdef01234567 (HEAD -> main), see flywheel/serve/loop.py",
    '{"id": "req_8f3a2b19c4", "version": "1.2.3", "count": 42, "ts": 1715941931, "ts_ms": 1715941931512}',
    "The job 1715941931 finished; order 4521876390 shipped; trace id 84726351920374 closed.",
    "The meeting is at 10:30 on 2024-06-01; bring 3 copies of the 25-page report.",
    "Matrix shape (32, 2048, 768); lr=3e-4; batch 256; warmup 1000 steps; 12000 rows in 1.5 s.",
    "Order #4521 shipped in 3-5 business days; it weighs 2.5 kg and costs $149.99.",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' LIMIT 100 OFFSET 200;",
    "ISBN 978-0-13-110362-7; DOI 10.1145/3290605.3300233; arXiv:2307.09288v2",
    "accuracy 0.912 / 0.874 / 0.866 over 3 seeds; p = 0.0312; n = 1024; see main.py and setup.sh",
    "Listen on port 51820 with MTU 1420; kernel 6.18.44-fc-v657-x86_64; glibc 2.36.",
    "sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  empty.txt",
    "PID 1234567 used 98.6% CPU for 3600 s; RSS 1536 MB; load average: 2.19, 3.39, 2.99",
    "The public policy on duplicate replicas uses the status of each license-free package.",
]


@pytest.fixture(scope="module")
def every_type() -> Detector:
    return Detector(SUPPORTED_ENTITIES)


def test_every_supported_type_has_an_example():
    assert {e for e, _, _ in EXAMPLES} == set(SUPPORTED_ENTITIES)
    assert set(DEFAULT_ENTITIES) | set(OPTIONAL_ENTITIES) == set(SUPPORTED_ENTITIES)
    assert not set(DEFAULT_ENTITIES) & set(OPTIONAL_ENTITIES)


@pytest.mark.parametrize("entity,text,value", EXAMPLES, ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(EXAMPLES)])
def test_each_type_is_found_at_its_exact_span(every_type, entity, text, value):
    start = text.index(value)
    detector = every_type if entity in OPTIONAL_ENTITIES else privacy.default_detector()
    spans = {(f.type, f.start, f.end) for f in detector.find(text)}
    assert (entity, start, start + len(value)) in spans, detector.find(text)
    assert all(f.value(text) == text[f.start:f.end] for f in detector.find(text))


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_has_no_finding(text):
    assert find(text) == []


def test_bare_digits_need_a_context_word():
    """Plain runs of digits are ids and timestamps far more often than personal data."""
    assert find("ref 9434765919 closed") == []  # a valid NHS number and US phone number, no context
    assert "UK_NHS" in {f.type for f in find("NHS number 9434765919")}  # "number" is also a phone's context
    assert find("trace 2125550198") == []
    assert [f.type for f in find("phone: 2125550198")] == ["PHONE_NUMBER"]
    assert [f.type for f in find("id 4111111111111111")] == ["CREDIT_CARD"]  # card numbers need none


def test_pieces_of_longer_words_and_short_check_digit_ids_are_not_findings():
    assert Detector(["MEDICAL_LICENSE"]).find("DEA BJ6125341")  # a DEA number on its own...
    assert find("DEA certificate fb2a3fa670837b5ad1347120363c2b310653f610") == []  # ...not in a hash
    assert find("ticket T22000129 closed") == []  # passes a German id card's check digit
    assert [f.type for f in find("Personalausweis T22000129")] == ["DE_ID_CARD"]
    japanese = "電話番号は+81 3 1234 5678です"  # no spaces around it: other scripts' letters do not glue
    assert [f.value(japanese) for f in find(japanese)] == ["+81 3 1234 5678"]


def test_a_detector_finds_only_its_types():
    text = "mail jane@example.com or call +44 20 7946 0958"
    assert [f.type for f in find(text)] == ["EMAIL_ADDRESS", "PHONE_NUMBER"]
    assert [f.type for f in Detector(["PHONE_NUMBER"]).find(text)] == ["PHONE_NUMBER"]
    assert Detector([]).find(text) == []
    with pytest.raises(ValueError, match="NOT_A_TYPE"):
        Detector(["EMAIL_ADDRESS", "NOT_A_TYPE"])
    with pytest.raises(TypeError):
        Detector("EMAIL_ADDRESS")


def test_findings_are_sorted_and_repeatable():
    text = "b@example.org, then 203.0.113.7 and a@example.com"
    first = find(text)
    assert [f.start for f in first] == sorted(f.start for f in first)
    assert find(text) == first  # from the cache
    assert Detector(cache_size=0).find(text) == first  # computed again
    assert find("") == []


# ---- redaction -----------------------------------------------------------------------------------

def test_redact_replaces_exactly_the_values_and_keeps_every_other_character():
    text = ("Ünïcödé 🙂 line one\r\n\tmail: jane.doe@example.com;\n"
            "card 4111 1111 1111 1111, phone (212) 555-0198.  trailing  spaces  \n")
    new, findings = redact(text)
    assert new == ("Ünïcödé 🙂 line one\r\n\tmail: <EMAIL_ADDRESS>;\n"
                   "card <CREDIT_CARD>, phone <PHONE_NUMBER>.  trailing  spaces  \n")
    assert [(f.type, f.value(text)) for f in findings] == [
        ("EMAIL_ADDRESS", "jane.doe@example.com"), ("CREDIT_CARD", "4111 1111 1111 1111"),
        ("PHONE_NUMBER", "(212) 555-0198"),
    ]


def test_redact_without_findings_returns_the_text_unchanged():
    text = ORDINARY[3]
    assert redact(text) == (text, [])


def test_redact_with_a_policy_detector():
    text = "jane@example.com, +44 20 7946 0958"
    assert redact(text, Detector(["PHONE_NUMBER"]))[0] == "jane@example.com, <PHONE_NUMBER>"


def test_overlapping_findings_become_one_placeholder_covering_them_all():
    text = "0123456789abcdefghij"
    f = lambda t, s, e, score=0.5: Finding(t, s, e, score)
    # nested: the container wins on length at equal score
    assert replace(text, [f("EMAIL_ADDRESS", 2, 12), f("URL", 5, 12)]) == "01<EMAIL_ADDRESS>cdefghij"
    # partial overlap: the union is replaced, named by the higher score
    assert replace(text, [f("A", 2, 8, 0.4), f("B", 6, 10, 0.9)]) == "01<B>abcdefghij"
    # a chain of overlaps is one group
    assert replace(text, [f("A", 0, 4), f("B", 3, 7), f("C", 6, 9, 0.6)]) == "<C>9abcdefghij"
    # same span, several types: the most confident names it, on a tie the first
    assert replace(text, [f("A", 2, 5), f("B", 2, 5, 0.9)]) == "01<B>56789abcdefghij"
    assert replace(text, [f("B", 2, 5), f("A", 2, 5)]) == "01<B>56789abcdefghij"
    # touching findings stay apart; order of the input does not matter
    assert replace(text, [f("B", 5, 8), f("A", 2, 5)]) == "01<A><B>89abcdefghij"
    assert replace(text, []) == text


def test_real_overlaps_are_redacted_whole(every_type):
    text = "driver license D1234567 and jane.doe@example.com"
    findings = every_type.find(text)
    assert len(findings) > 2  # licence and passport on one value; e-mail and URLs in the other
    new, _ = redact(text, every_type)
    assert new == "driver license <US_DRIVER_LICENSE> and <EMAIL_ADDRESS>"


# ---- one engine, threads -------------------------------------------------------------------------

def test_one_engine_per_process_shared_by_detectors_and_threads():
    from flywheel.privacy import engine

    texts = [f"user{i}@example.com called +44 20 7946 {1000 + i}" for i in range(64)]
    serial = [Detector(cache_size=0).find(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(lambda t: Detector(cache_size=0).find(t), texts))
    assert threaded == serial and all(len(f) == 2 for f in serial)
    assert engine.analyzer() is engine.analyzer()
    assert engine.builds == 1


# ---- the adjusted recognizers --------------------------------------------------------------------

def test_phone_masking_finds_what_the_whole_text_gives():
    """`adjusted.Phone` hides from the matcher the text far from long chains of digits, and bare
    digit runs without a context word; its findings must be those of Presidio's recognizer run
    on the whole text, less the ones the detector drops anyway."""
    from presidio_analyzer.predefined_recognizers import PhoneRecognizer

    from flywheel.privacy.adjusted import (
        _PHONE_RUN,
        Phone,
        mask_for_phones,
        trim_opening_bracket,
    )
    from flywheel.privacy.context import WholeWordContext
    from flywheel.privacy.nlp import RegexNlpEngine

    nlp, enhancer = RegexNlpEngine(), WholeWordContext()
    nlp.load()
    whole, masked = PhoneRecognizer(leniency=2), Phone()  # Presidio's default regions, CA included

    def dropped_anyway(text, r, artifacts) -> bool:
        value = text[r.start:r.end]
        if _PHONE_RUN.search(value) is None:  # fewer than MIN_DIGITS digits
            return True
        words = enhancer._extract_surrounding_words(artifacts, value, r.start)
        return value.isdigit() and not enhancer._find_supportive_word_in_context(words, whole.context)

    rng = random.Random(0)
    phones = ["+44 20 7946 0958", "(212) 555-0198", "212.555.0198", "+1-212-555-0198 ext. 1234",
              "030 12345678", "+33 1 23 45 67 89", "+91 98765 43210", "+55 11 91234-5678", "2125550198",
              "+442079460958", "(416) 555-0123", "1640", "0.169.0", "[2125550198]", "(2125550198)"]
    fillers = ORDINARY + ["phone", "mobile:", "tel", "x", "\n", "(", ")", "+", "-", " ", "12", "3.5",
                          "2024-01-09 16:31:25,940 INFO", "at 2024-12-27 21:40", "[965120264, 2125550198]"]
    found = 0
    for _ in range(200):
        text = " ".join(rng.choice(phones) if rng.random() < 0.3 else rng.choice(fillers) for _ in range(12))
        assert mask_for_phones(text) is None or len(mask_for_phones(text)) == len(text)
        artifacts = nlp.process_text(text, "en")
        reference = whole.analyze(text, ["PHONE_NUMBER"])
        for r in reference:
            r.start = trim_opening_bracket(text, r.start, r.end)
        expected = sorted((r.start, r.end) for r in reference if not dropped_anyway(text, r, artifacts))
        got = sorted((r.start, r.end) for r in masked.analyze(text, ["PHONE_NUMBER"], artifacts)
                     if not dropped_anyway(text, r, artifacts))
        assert got == expected, text
        found += len(got)
    assert found > 100


def test_context_token_lookup_matches_presidios():
    from presidio_analyzer.context_aware_enhancers import LemmaContextAwareEnhancer

    from flywheel.privacy.context import WholeWordContext
    from flywheel.privacy.nlp import tokenize

    text = "My  SSN:078-05-1120, call (212) 555-0198;\tdone. Ünï 🙂 x"
    tokens, starts = tokenize(text)
    for start in range(len(text) - 1):
        if text[start].isspace():
            continue
        expected = LemmaContextAwareEnhancer._find_index_of_match_token("w", start, list(tokens), starts)
        assert WholeWordContext._find_index_of_match_token("w", start, tokens, starts) == expected


def test_keywords_are_presidios():
    from presidio_analyzer.nlp_engine import NlpArtifacts

    from flywheel.privacy.nlp import RegexNlpEngine

    nlp = RegexNlpEngine()
    nlp.load()
    for text in ORDINARY + [e[1] for e in EXAMPLES] + ["Ünï 🙂 -PRON- Be: be ssn: The, AND; of"]:
        ours = nlp.process_text(text, "en")
        theirs = NlpArtifacts(entities=[], tokens=ours.tokens, tokens_indices=ours.tokens_indices,
                              lemmas=ours.lemmas, nlp_engine=nlp, language="en")
        assert ours.keywords == frozenset(theirs.keywords)
