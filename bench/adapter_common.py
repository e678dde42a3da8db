"""What the adapter benchmarks (`bench/adapter_throughput.py`, `bench/adapter_swap.py`) share:
random PEFT adapters written straight to disk, the embedded engine and a vLLM server with LoRA
on, and one timed batch through either.

Adapters: PEFT's directory format (`adapter_config.json` from PEFT's own `LoraConfig`,
`adapter_model.safetensors` with `base_model.model.<module>.lora_A/lora_B.weight`) for every
linear layer of the model but its output head, A ~ N(0, 1/in) and B ~ N(0, 0.02²): nonzero B,
so every row really adds its low-rank product. Written without building a PEFT model (1,000
adapters in seconds), the layers and shapes read off the model.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.lib.common import CpuWatch, bench_model, wait_quiet_async
from flywheel.torch_threads import one_thread

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_layers(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """(module path, in features, out features) of each layer an all-linear adapter adapts."""
    return [(name, module.in_features, module.out_features) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR]


def write_adapter(path: Path, layers: list[tuple[str, int, int]], rank: int, seed: int) -> Path:
    """A random rank-`rank` PEFT adapter over `layers` in directory `path`, drawn on one thread: the
    benchmark's engine decodes on another thread of this process (`flywheel.torch_threads`)."""
    from peft import LoraConfig

    path.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LINEAR, task_type="CAUSAL_LM").to_dict()
    (path / "adapter_config.json").write_text(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with one_thread():
        for name, fan_in, fan_out in layers:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def write_adapters(root: Path, model: torch.nn.Module, names: list[str], rank: int, seed: int = 0) -> dict[str, Path]:
    """{name: directory} of random adapters `root/<name>`, one seed each."""
    layers = adapted_layers(model)
    return {name: write_adapter(root / name, layers, rank, seed + i) for i, name in enumerate(names)}


def embedded_engine(model_spec: str, max_batch_size: int, max_loras: int, lora_root: Path | None = None,
                    dtype: str = "float32", device: str = "cpu", random_weights: bool = False, cuda_graphs: bool = True):
    """A started embedded engine (its own decoder; on CUDA its steps replayed from graphs unless
    `cuda_graphs` is false) on its own copy of the model, in `dtype` on `device` (`bench_model`:
    real or seeded random weights)."""
    from flywheel.serve.engine import Engine

    model, tokenizer = bench_model(model_spec, dtype, device, random_weights)
    return Engine(model, tokenizer, max_batch_size=max_batch_size, max_loras=max_loras,
                  lora_root=str(lora_root) if lora_root else None, cuda_graphs=cuda_graphs).start()


def start_vllm(model_spec: str, log_dir: Path, max_num_seqs: int, max_loras: int, rank: int):
    """A vLLM server as Flywheel starts it with `adapters.kind: lora` (`vllm_server.lora_flags`)."""
    from flywheel.serve.backends.vllm_server import VLLMServer

    server = VLLMServer(model_spec, "base", log_dir, max_num_seqs=max_num_seqs, lora=(max_loras, rank))
    server.start()
    return server


async def timed_batch(engine: Any, prompts: list[list[int]], adapters: list[str | None], lengths: list[int],
                      seed: int = 0, quiet: bool = True) -> dict[str, Any]:
    """All rows at once through `engine` (the embedded `Engine`, or a `VLLMEngineClient`), each
    row i its prompt, adapter and exact length (`ignore_eos`, temperature 1, seeded): tokens,
    wall, tok/s, and how many cores others used meanwhile."""
    if quiet:
        await wait_quiet_async(max_wait_s=20)
    watch = CpuWatch().start()
    started = time.monotonic()
    rows = await asyncio.gather(*(_one(engine, ids, adapter, n, seed + i)
                                  for i, (ids, adapter, n) in enumerate(zip(prompts, adapters, lengths))))
    wall = time.monotonic() - started
    noise = watch.stop()
    tokens = sum(rows)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1), "foreign_cores": noise["foreign_cores"]}


def served_body(ids: list[int], adapter: str | None, n: int, seed: int) -> dict[str, Any]:
    """A request on SGLang's protocol (an engine server's client): `n` tokens exactly, temperature
    1, seeded, on `adapter` (`lora_path`) or the base."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True,
                                                  "sampling_seed": seed}}
    return body if adapter is None else body | {"lora_path": adapter}


async def _one(engine: Any, ids: list[int], adapter: str | None, n: int, seed: int) -> int:
    if hasattr(engine, "generate_stream"):  # a client of an engine server (SGLang's protocol)
        return len((await engine.generate(served_body(ids, adapter, n, seed)))["output_ids"])
    from flywheel.serve.engine import SamplingParams

    params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)
    return len((await engine.generate(ids, params, adapter=adapter)).output_ids)


def spread(names: list[str], n_rows: int) -> list[str]:
    """`n_rows` adapters, the names taken in turn (rows spread evenly over them)."""
    return [names[i % len(names)] for i in range(n_rows)]
