"""Flywheel's embedded engine: torch + transformers generation speaking SGLang's protocol."""

from serve.engine.core import Engine, GenerationResult
from serve.engine.native import ProtocolError, generate, version_spans
from serve.engine.sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "ProtocolError", "SamplingParams", "generate", "version_spans"]
