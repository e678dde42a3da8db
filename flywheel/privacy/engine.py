"""The one Presidio `AnalyzerEngine` of the process, built from explicit parts on first use.

Presidio's defaults are never used: `AnalyzerEngine()` with no arguments loads the spaCy model
`en_core_web_lg` (and calls `spacy.cli.download` when it is missing), and its default registry
instantiates recognizers that fetch models from the Hugging Face hub. Here the NLP engine is
`flywheel.privacy.nlp.RegexNlpEngine` (no model) and the registry holds exactly one recognizer
per entity type of `flywheel.privacy.entities`, all of them, so every detector shares the engine
and each call runs only the recognizers of the types it asks for.

`analyzer()` builds the engine under a lock the first time it is called (about 10 ms after the
imports; importing presidio_analyzer costs seconds, most of it torch and transformers, which a
gateway process has loaded already) and returns the same engine ever after. Presidio's analyzer
holds no per-call state: recognizers compile their patterns on first use (the same pattern each
time), and results are new objects, so one engine serves any number of threads.
"""

from __future__ import annotations

import threading

from flywheel.privacy.entities import LANGUAGE, RECOGNIZERS, SUPPORTED_ENTITIES

_lock = threading.Lock()
_analyzer = None
builds = 0  # how many engines this process has built (it should stay at 1)


def analyzer():
    """The process's `presidio_analyzer.AnalyzerEngine`, built on the first call."""
    global _analyzer, builds
    if _analyzer is None:
        with _lock:
            if _analyzer is None:
                _analyzer = _build()
                builds += 1
    return _analyzer


def create_recognizer(entity: str):
    """A new recognizer for `entity` (a name in `entities.RECOGNIZERS`), under `LANGUAGE`."""
    import presidio_analyzer.predefined_recognizers as predefined

    from flywheel.privacy import adjusted

    name = RECOGNIZERS[entity]
    cls = adjusted.REPLACES.get(name) or getattr(predefined, name)
    recognizer = cls(supported_language=LANGUAGE)
    if entity not in recognizer.supported_entities:
        raise AssertionError(f"{name} detects {recognizer.supported_entities}, not {entity}")
    return recognizer


def _build():
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry

    from flywheel.privacy.context import WholeWordContext
    from flywheel.privacy.nlp import RegexNlpEngine

    nlp_engine = RegexNlpEngine([LANGUAGE])
    nlp_engine.load()
    registry = RecognizerRegistry(
        recognizers=[create_recognizer(e) for e in SUPPORTED_ENTITIES], supported_languages=[LANGUAGE],
    )
    return AnalyzerEngine(registry=registry, nlp_engine=nlp_engine, supported_languages=[LANGUAGE],
                          context_aware_enhancer=WholeWordContext())
