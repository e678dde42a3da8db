"""A version of known harm: `tiny`'s weights (or a checkpoint's) with Gaussian noise on every
weight, published to a `WeightStore`. What the promotion drill and tests publish as a harmful
version for the gate and the canary to catch (noise 0: the weights unchanged, a harmless one)."""

from __future__ import annotations

import torch

from flywheel.models import WeightStore, load_model, load_weights


def publish_noised(store: WeightStore, version: int, noise: float, source: str | None = None) -> str:
    """Publish `version`: the weights in `source` (default: the starting `tiny`), plus Gaussian
    noise of standard deviation `noise` on every weight (seeded by the version). -> its path."""
    model, _ = load_model("tiny")
    if source is not None:
        load_weights(model, source)
    if noise:
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * noise)
    return str(store.publish(model, version))
