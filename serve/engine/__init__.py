"""Flywheel's embedded engine: torch + transformers generation speaking SGLang's protocol."""

from serve.engine.core import Engine
from serve.engine.native import ProtocolError, generate, generate_stream, version_spans
from serve.engine.request import GenerationResult, RequestFailed, TokenDelta
from serve.engine.sampling import SamplingParams
from serve.engine.threads import torch_threads

__all__ = [
    "Engine", "GenerationResult", "ProtocolError", "RequestFailed", "SamplingParams", "TokenDelta",
    "generate", "generate_stream", "torch_threads", "version_spans",
]
