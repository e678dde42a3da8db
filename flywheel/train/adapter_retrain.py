"""Adapters rebuilt without forgotten samples: `flywheel forget --tenant T --user U --retrain` under
`adapters.kind: lora`.

Forgetting deletes the forgotten people's own adapters (flywheel/tenants/forget.py); the adapters
they trained together with others (their tenant's under `adapters.scope: tenant`, the
deployment's `shared`) still hold what their samples taught. Each of those is rebuilt as
flywheel/train/retrain.py rebuilds the shared weights, from its own lines of the ledger:

1. the start is the newest checkpoint from before the first of its steps that used a forgotten
   sample, with the adapter's weights, optimizer, schedule and reward baseline there; where that
   checkpoint does not hold the adapter (made after it), the adapter starts as a new one does
   (PEFT's initialisation: the base);
2. each of its later steps, up to the newest checkpoint, is taken again on its samples less the
   forgotten ones and those SAMPLES no longer holds (`missing`);
3. each step taken again makes a version of its own, above every one the adapter had; every
   checkpoint after the start then holds the adapter as those steps left it by that checkpoint's
   step (so a later retrain can start there), the newest first, its version, and no forgotten
   sample in its trained list; the ledger takes the adapter back to its version at the start and
   names the steps taken again; last, the rebuilt adapter is published as the newest of those
   versions (one more where no step was left) and announced, so the gateways serve it at once (a
   crash before then leaves the newest checkpoint rebuilt: the trainer that starts next publishes
   it, its guard asked), and the stored versions it replaces (trained on the forgotten samples or
   after them) are deleted, so no rollback serves one again; an audit entry (`retrain`) names the
   adapter and the version.

Other adapters, their checkpoints' states and versions are untouched. The adapter guard
(`adapters.guard_*`) is not asked here: the rebuilt adapter learned from part of what its
published versions learned from, on the same steps. A retrain cut off part way cannot be run
again (the forgotten samples' digests were read from the records the forget deleted): the newest
checkpoint is rewritten first, so the trainer goes on from the rebuilt adapter, but older
checkpoints may still hold what they taught. Steps after the newest checkpoint are not taken again
here: the trainer that starts next goes back to that checkpoint and trains their samples again,
the forgotten ones gone from the bus. The trainer must be stopped (the caller holds
`run_dir/train.lock`); a trainer that starts next goes on from the rebuilt adapters. Not under
promotion (`promotion.mode` not off): there a tenant's or the shared adapter is a line of the
version registry, which a retrain would have to go through (refused).
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.models import load_model
from flywheel.models.adapter_store import AdapterStore, owned_by
from flywheel.tenants.forgotten import target_of
from flywheel.train.adapter_versions import AdapterVersions
from flywheel.train.advantages import RunningBaseline
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.forget_adapters import rewrite
from flywheel.train.ledger import Ledger, lineage
from flywheel.train.retrain import held_samples, take_again
from flywheel.train.trainer import Trainer


@dataclass
class RetrainedAdapter:
    """What `retrain_adapters` did to one adapter."""

    adapter: str
    from_step: int
    """The step of the checkpoint it started from (0: a new adapter's start, where none held it)."""
    steps: int
    samples: int
    left_out: int
    """Forgotten samples its original steps used."""
    missing: int
    """Samples of its replayed steps the SAMPLES stream no longer holds (past its age)."""
    version: int


async def retrain_adapters(config: FlywheelConfig, bus: Any, forgotten: set[str], tenant: str, user: str | None,
                           actor: str = "cli") -> list[dict[str, Any]]:
    """Rebuild every adapter but the forgotten `tenant`'s (or `user`'s) own that the samples whose
    digests are `forgotten` trained (see the module docstring); what was done to each. The caller
    holds the run directory's `RunLock`."""
    if config.promotion.enabled:
        raise ConfigError("promotion.mode: adapters are not retrained under promotion (their lines are the registry's)")
    run_dir = Path(config.run_dir)
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=config.train.keep_checkpoints)
    steps = lineage(run_dir / "trained.jsonl") if (run_dir / "trained.jsonl").exists() else []
    newest = checkpoints.steps()[-1] if checkpoints.steps() else 0
    learned = {s["adapter"] for s in steps if s.get("adapter") and s["step"] <= newest and forgotten.intersection(s["samples"])}
    deleted = set(owned_by(learned, tenant, user))
    target = target_of(tenant, user)
    done = []
    for name in sorted(learned - deleted):
        report = await _retrain(config, bus, checkpoints, [s for s in steps if s.get("adapter") == name], newest,
                                forgotten, name)
        await bus.publish(AUDIT_SUBJECT, AuditEntry(id=uuid.uuid4().hex, actor=actor, action="retrain",
                                                    target=f"{name} v{report.version}",
                                                    details={"without": target, **asdict(report)}))
        done.append(asdict(report))
    return done


async def _retrain(config: FlywheelConfig, bus: Any, checkpoints: Checkpoints, lines: list[dict[str, Any]],
                   newest: int, forgotten: set[str], name: str) -> RetrainedAdapter:
    """Adapter `name` rebuilt from its ledger `lines`, published, and put in the checkpoints."""
    first = next(s["step"] for s in lines if forgotten.intersection(s["samples"]))
    start = max((s for s in checkpoints.steps() if s < first), default=0)
    replay = [s for s in lines if start < s["step"] <= newest]
    held = await held_samples(bus, {d for s in replay for d in s["samples"]} - forgotten)

    torch.manual_seed(config.seed)
    torch.set_num_threads(config.train.torch_threads)  # the trainer's: its numbers, not a near copy
    model, tokenizer = await asyncio.to_thread(load_model, config.model)
    trainer = Trainer(model, config.actor, config.train, config.adapters)
    assert trainer.adapters is not None
    baseline, was = RunningBaseline(), 0
    state = await asyncio.to_thread(checkpoints.load, checkpoints.path(start), None) if start else None
    saved = [a for a in state["trainer"]["adapters"] if a["name"] == name] if state else []
    if saved:
        trainer.adapters.restore(saved)
        baseline.of(name).value = state["loop"].get("adapter_baselines", {}).get(name, 0.0)
        was = state["loop"].get("adapters", {}).get("versions", {}).get(name, 0)
    else:  # made after the start: from a new adapter's start
        trainer.adapters.ensure(name)

    report = RetrainedAdapter(name, start if saved else 0, 0, 0, 0, 0, 0)
    store = AdapterStore(Path(config.run_dir) / "adapters", keep=config.train.keep_versions)
    above = max([store.latest(name) or 0, *(s["version"] for s in lines)])
    later = [c for c in checkpoints.steps() if c > start]
    held_at: dict[int, Held] = {}
    version, taken = was, []
    for step in replay:
        for c in later:  # the checkpoints before this step hold the adapter as it is now
            if c < step["step"] and c not in held_at:
                held_at[c] = _held(trainer, baseline, name, version, bool(saved or taken))
        samples = [held[d] for d in step["samples"] if d in held]
        report.left_out += sum(d in forgotten for d in step["samples"])
        report.missing += sum(d not in forgotten and d not in held for d in step["samples"])
        if samples:
            await asyncio.to_thread(take_again, trainer, samples, config, baseline, tokenizer.pad_token_id or 0)
            version = above + len(taken) + 1  # each step taken again its own version: a later retrain starts between them
            taken.append((step["step"], version, [d for d in step["samples"] if d in held]))
            report.steps += 1
            report.samples += len(samples)
    report.version = version if taken else above + 1
    for c in (c for c in later if c not in held_at):
        held_at[c] = _held(trainer, baseline, name, report.version if c == newest else version,
                           bool(saved or taken) or c == newest)

    await asyncio.to_thread(_into_checkpoints, checkpoints, name, held_at, forgotten)  # the newest first
    ledger = Ledger(Path(config.run_dir) / "trained.jsonl")
    try:
        ledger.back_to(was, adapter=name)
        for number, made, digests in taken:
            ledger.trained(number, made, digests, adapter=name)
    finally:
        ledger.close()
    versions = AdapterVersions(store, bus, interval=1)
    versions.versions[name], versions.parents[name] = report.version, was
    await versions.publish(trainer.adapters, name, newest)  # last: until then a trainer that starts publishes it
    for stale in (v for v in store.versions(name) if was < v <= above):  # trained on forgotten samples, or after them
        store.delete_version(name, stale)
    return report


Held = tuple[dict[str, Any], float, int, bool]
"""What a checkpoint is to hold of the adapter: its saved state, reward baseline and version, and
whether it is to be there where the checkpoint did not have it (it was made by then)."""


def _held(trainer: Trainer, baseline: RunningBaseline, name: str, version: int, there: bool) -> Held:
    """The adapter as `trainer` has it now (a copy: later steps change it in place)."""
    assert trainer.adapters is not None
    return copy.deepcopy(trainer.adapters.state()[0]), baseline.of(name).value, version, there


def _into_checkpoints(checkpoints: Checkpoints, name: str, held_at: dict[int, Held], forgotten: set[str]) -> None:
    """Each checkpoint of `held_at`, the newest first, holding the adapter as given there (where it
    is to be), and its trained list without the forgotten samples."""
    for step in sorted(held_at, reverse=True):
        path = checkpoints.path(step) / "state.pt"
        state = torch.load(path, weights_only=False)
        rebuilt, baseline, version, there = held_at[step]
        saved, loop = state["trainer"]["adapters"], state["loop"]
        if there or any(a["name"] == name for a in saved):
            state["trainer"]["adapters"] = [a for a in saved if a["name"] != name] + [rebuilt]
            loop.setdefault("adapter_baselines", {})[name] = baseline
            tables = loop.setdefault("adapters", {})
            tables.setdefault("versions", {})[name] = tables.setdefault("parents", {})[name] = version
        loop["trained"] = [d for d in loop.get("trained", []) if d not in forgotten]
        rewrite(path, state)
