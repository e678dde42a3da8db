"""The weights a trial ended with, as one model directory, for evaluating them offline: the
newest version in the weight store (full fine-tuning), or, with `adapters.kind: lora`, the base
with the newest version of an adapter (the trial's one, or a named one) merged in (PEFT's `merge_and_unload`), so the
held-out and general-skill evaluations load either the same way."""

from __future__ import annotations

from pathlib import Path

from flywheel.config import FlywheelConfig
from flywheel.models import WeightStore, load_model
from flywheel.models.adapter_store import AdapterStore


def final_policy(config: FlywheelConfig, run_dir: Path, adapter: str | None = None) -> Path | None:
    """The trial's final weights (None: it never published any); with adapters, `adapter`'s (by
    default the trial's one adapter)."""
    if config.adapters.kind != "lora":
        store = WeightStore(run_dir / "weights")
        latest = store.latest()
        return store.path(latest) if latest is not None else None
    from peft import PeftModel

    adapters = AdapterStore(run_dir / "adapters")
    names = adapters.names() if adapter is None else [adapter]
    if len(names) > 1:
        raise ValueError(f"a trial of one person trains one adapter; {run_dir} has {names}")
    version = adapters.latest(names[0]) if names else None
    if version is None:
        return None
    [name] = names
    merged = run_dir / "merged" / f"{name}-v{version}"
    if not merged.is_dir():
        base, _ = load_model(config.model)
        PeftModel.from_pretrained(base, str(adapters.path(name, version))).merge_and_unload().save_pretrained(merged)
    return merged
