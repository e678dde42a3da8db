"""Personal data in prompts and replies: find it, or replace it with placeholders, offline.

The gateway calls `find(text)` on each message's text and on the reply, and `redact(text)` on the
texts of user and tool messages; a tenant's policy then drops the turn from storage or sends the
redacted prompt to the model. Both use Microsoft Presidio's pattern recognizers (e-mail, phone,
credit card, IBAN, IP, crypto, US SSN/ITIN/passport/driver licence/bank account, and other
countries' national ids: `DEFAULT_ENTITIES`) with no model and no network: names, places and
other things only a trained model could find are not detected.

    from flywheel.privacy import Detector, find, redact
    find("write to jane@example.com")           # [Finding("EMAIL_ADDRESS", 9, 25, 1.0)]
    redact("write to jane@example.com")         # ("write to <EMAIL_ADDRESS>", [...])
    Detector(["EMAIL_ADDRESS", "PHONE_NUMBER"]).find(text)   # a policy's own list

Modules: `findings` (the result type), `entities` (the types and their recognizers), `nlp` (the
model-free tokenizer Presidio needs), `adjusted` (three recognizers made offline and fast),
`engine` (the process's one Presidio engine), `detector` (find), `redact` (placeholders).
Importing this package does not import Presidio; the first `find` does (or call `load()` at
start-up).
"""

from flywheel.privacy.detector import (
    DEFAULT_SCORE_THRESHOLD,
    Detector,
    default_detector,
    find,
)
from flywheel.privacy.engine import analyzer as load
from flywheel.privacy.entities import (
    DEFAULT_ENTITIES,
    LANGUAGE,
    OPTIONAL_ENTITIES,
    SUPPORTED_ENTITIES,
    check_entities,
)
from flywheel.privacy.findings import Finding
from flywheel.privacy.redact import redact, replace

__all__ = [
    "DEFAULT_ENTITIES", "DEFAULT_SCORE_THRESHOLD", "LANGUAGE", "OPTIONAL_ENTITIES", "SUPPORTED_ENTITIES",
    "Detector", "Finding", "check_entities", "default_detector", "find", "load", "redact", "replace",
]
