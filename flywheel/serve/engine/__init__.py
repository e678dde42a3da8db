"""Flywheel's embedded engine: torch + transformers generation speaking SGLang's protocol."""

from flywheel.serve.engine.core import Engine
from flywheel.serve.engine.cpu_threads import torch_threads
from flywheel.serve.engine.native import (
    AdapterNotFound,
    ProtocolError,
    generate,
    generate_stream,
    version_spans,
)
from flywheel.serve.engine.request import GenerationResult, RequestFailed, TokenDelta
from flywheel.serve.engine.sampling import SamplingParams

__all__ = [
    "AdapterNotFound", "Engine", "GenerationResult", "ProtocolError", "RequestFailed", "SamplingParams", "TokenDelta",
    "generate", "generate_stream", "torch_threads", "version_spans",
]
