"""The entity types the detector can look for, and the Presidio recognizer class behind each.

Every recognizer named here is a pattern recognizer (regular expressions, checksums, or
python-phonenumbers): none loads a model or reaches the network. `flywheel.privacy.engine`
creates them by class name from `presidio_analyzer.predefined_recognizers` (never the whole
package's defaults: some classes there download models when instantiated), three of them in the
adjusted versions of `flywheel.privacy.adjusted`. This module imports nothing from Presidio, so
the names can be checked (a tenant's policy, say) without loading it.

All recognizers are registered under one Presidio language key, `LANGUAGE` ("en"). The patterns
do not depend on the language of the text, and each recognizer keeps its own context words
(English for the generic ones, the country's language for national ids such as the Spanish NIF
or the Italian codice fiscale), so one pass finds every requested type in text of any language.

`DEFAULT_ENTITIES` are the structured identifiers that are personal data on their own: contact
details, payment details, network addresses and government ids. `OPTIONAL_ENTITIES` can be asked
for by name but are off by default, because in an agent's traffic (code, logs, tool output) they
fire on ordinary text: URL matches file and module names such as `loop.py`, `judges.md` or
`flywheel.tr` (`.py`, `.md`, `.tr` are country domains: 8,567 findings in this repository's own
docs and code), DATE_TIME every date, UUID and MAC_ADDRESS are mostly object and device ids, and
company numbers, postcodes and vehicle plates are not personal on their own.
"""

from __future__ import annotations

from collections.abc import Iterable

LANGUAGE = "en"

# entity type -> recognizer class name in presidio_analyzer.predefined_recognizers
RECOGNIZERS: dict[str, str] = {
    # contact, payment, network
    "EMAIL_ADDRESS": "EmailRecognizer",
    "PHONE_NUMBER": "PhoneRecognizer",
    "CREDIT_CARD": "CreditCardRecognizer",
    "IBAN_CODE": "IbanRecognizer",
    "IP_ADDRESS": "IpRecognizer",
    "CRYPTO": "CryptoRecognizer",
    # United States
    "US_SSN": "UsSsnRecognizer",
    "US_ITIN": "UsItinRecognizer",
    "US_PASSPORT": "UsPassportRecognizer",
    "US_DRIVER_LICENSE": "UsLicenseRecognizer",
    "US_BANK_NUMBER": "UsBankRecognizer",
    "MEDICAL_LICENSE": "MedicalLicenseRecognizer",
    # other countries' personal ids
    "UK_NHS": "NhsRecognizer",
    "UK_NINO": "UkNinoRecognizer",
    "UK_PASSPORT": "UkPassportRecognizer",
    "UK_DRIVING_LICENCE": "UkDrivingLicenceRecognizer",
    "CA_SIN": "CaSinRecognizer",
    "ES_NIF": "EsNifRecognizer",
    "ES_NIE": "EsNieRecognizer",
    "IT_FISCAL_CODE": "ItFiscalCodeRecognizer",
    "IT_IDENTITY_CARD": "ItIdentityCardRecognizer",
    "IT_PASSPORT": "ItPassportRecognizer",
    "IT_DRIVER_LICENSE": "ItDriverLicenseRecognizer",
    "PL_PESEL": "PlPeselRecognizer",
    "DE_TAX_ID": "DeTaxIdRecognizer",
    "DE_ID_CARD": "DeIdCardRecognizer",
    "DE_PASSPORT": "DePassportRecognizer",
    "DE_SOCIAL_SECURITY": "DeSocialSecurityRecognizer",
    "DE_HEALTH_INSURANCE": "DeHealthInsuranceRecognizer",
    "FI_PERSONAL_IDENTITY_CODE": "FiPersonalIdentityCodeRecognizer",
    "SE_PERSONNUMMER": "SePersonnummerRecognizer",
    "IN_AADHAAR": "InAadhaarRecognizer",
    "IN_PAN": "InPanRecognizer",
    "IN_PASSPORT": "InPassportRecognizer",
    "IN_VOTER": "InVoterRecognizer",
    "SG_NRIC_FIN": "SgFinRecognizer",
    "AU_TFN": "AuTfnRecognizer",
    "AU_MEDICARE": "AuMedicareRecognizer",
    "KR_RRN": "KrRrnRecognizer",
    "KR_PASSPORT": "KrPassportRecognizer",
    "TH_TNIN": "ThTninRecognizer",
    "TR_NATIONAL_ID": "TrNationalIdRecognizer",
    "NG_NIN": "NgNinRecognizer",
    "ZA_ID_NUMBER": "ZaIdNumberRecognizer",
    "PH_UMID": "PhUmidRecognizer",
    # optional: see the module docstring
    "URL": "UrlRecognizer",
    "DATE_TIME": "DateRecognizer",
    "UUID": "UuidRecognizer",
    "MAC_ADDRESS": "MacAddressRecognizer",
    "UK_POSTCODE": "UkPostcodeRecognizer",
    "CA_POSTAL_CODE": "CaPostalCodeRecognizer",
    "UK_VEHICLE_REGISTRATION": "UkVehicleRegistrationRecognizer",
    "IN_VEHICLE_REGISTRATION": "InVehicleRegistrationRecognizer",
    "AU_ABN": "AuAbnRecognizer",
    "AU_ACN": "AuAcnRecognizer",
    "SG_UEN": "SgUenRecognizer",
}

OPTIONAL_ENTITIES: tuple[str, ...] = (
    "URL", "DATE_TIME", "UUID", "MAC_ADDRESS", "UK_POSTCODE", "CA_POSTAL_CODE",
    "UK_VEHICLE_REGISTRATION", "IN_VEHICLE_REGISTRATION", "AU_ABN", "AU_ACN", "SG_UEN",
)
SUPPORTED_ENTITIES: tuple[str, ...] = tuple(RECOGNIZERS)
DEFAULT_ENTITIES: tuple[str, ...] = tuple(e for e in RECOGNIZERS if e not in OPTIONAL_ENTITIES)


def check_entities(entities: Iterable[str]) -> tuple[str, ...]:
    """`entities` as a tuple without duplicates, in order; ValueError naming any unknown type."""
    if isinstance(entities, str):
        raise TypeError("entities must be a list of names, not one string")
    names = tuple(dict.fromkeys(entities))
    unknown = [e for e in names if e not in RECOGNIZERS]
    if unknown:
        raise ValueError(f"unknown entity types {unknown}; supported: {list(SUPPORTED_ENTITIES)}")
    return names
