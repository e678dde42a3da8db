"""The multi-GPU path: FSDP2 (`torch.distributed.fsdp.fully_shard`) over the ranks of an
initialised process group, one shard unit per decoder layer plus the root.

Guarded: `train.fsdp` without a process group or without CUDA is a config error. Launch with
`torchrun --nproc-per-node N` so every rank runs the trainer; each rank then computes its
micro-batches and FSDP reduces the gradients. This path cannot run on a CPU-only machine and is
not covered by the test suite; only the guard is.
"""

from __future__ import annotations

import torch

from flywheel.config import ConfigError


def shard(model: torch.nn.Module) -> torch.nn.Module:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("train.fsdp: needs an initialised torch.distributed process group (launch under torchrun)")
    if not torch.cuda.is_available():
        raise ConfigError("train.fsdp: needs CUDA devices")
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model
