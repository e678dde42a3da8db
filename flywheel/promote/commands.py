"""Operators' commands on the registry (`flywheel versions`, the gateway's admin routes), carried
out by the promotion loop in order, each one's result written back (`CommandResult`).

A command names a line: the shared weights' (no `adapter`), or a shared or tenant adapter's.
- `promote N`: version N serves its line (an adapter's version 0 is its start, the bare base).
- `rollback [N]`: what serves is rolled back, and N serves instead (default: the line's last
  version that served before it; for an adapter, its start when none did). A canary of the shared
  weights is rolled back first, if one runs. The trainer is told to continue from what serves now.
- `pin N`: N serves, and no candidate of the line is evaluated until `unpin`.
"""

from __future__ import annotations

from flywheel.promote.decisions import Decisions
from flywheel.promote.states import move
from flywheel.versions.records import VersionCommand, last_good


async def carry_out(decisions: Decisions, command: VersionCommand) -> str:
    """Carry out `command`; what was done. LookupError, ValueError or IllegalTransition: refused."""
    said = f"{command.operator}: {command.reason or command.kind}"
    if command.adapter is not None:
        return await _on_adapter(decisions, command, command.adapter, said)
    routing = await decisions.routing()
    if command.kind == "unpin":
        await decisions.set_routing(routing, said, pinned=False)
        return "unpinned: candidates are evaluated again"
    if command.kind == "rollback":
        if command.version is None and routing.canary is not None:
            await decisions.reject(await decisions.entry(routing.canary.version), "rolled_back", said, "operator")
            return f"canary v{routing.canary.version} rolled back"
        current = await decisions.entry(routing.serving.version)
        target = (await decisions.entry(command.version) if command.version is not None
                  else last_good(await decisions.registry.versions(), besides=current.version))
        if target is None:
            raise LookupError(f"no version served before v{current.version}: nothing to roll back to")
        await decisions.registry.put(move(current, "rolled_back", said, "operator"))
        await decisions.serve(await decisions.entry(target.version), said, "operator")
        await decisions.direct_trainer(target, current.version, f"v{current.version} rolled back by {command.operator}")
        return f"v{current.version} rolled back; v{target.version} serves"
    entry = await decisions.entry(_version(command))
    if entry.state != "serving":
        await decisions.serve(entry, said, "operator")
    if command.kind == "pin":
        await decisions.set_routing(await decisions.routing(), said, pinned=True)
        return f"v{entry.version} serves, pinned"
    return f"v{entry.version} serves"


async def _on_adapter(decisions: Decisions, command: VersionCommand, adapter: str, said: str) -> str:
    if adapter not in await decisions.registry.adapters():
        raise LookupError(f"no adapter {adapter} in the registry")
    pinned = (await decisions.routing()).pinned_adapters
    if command.kind == "unpin":
        await decisions.set_routing(await decisions.routing(), said, pinned_adapters=[a for a in pinned if a != adapter])
        return f"{adapter} unpinned: its candidates are evaluated again"
    if command.kind == "rollback":
        current = await decisions.serving_adapter(adapter)
        if current.version == 0:
            raise LookupError(f"{adapter} serves its start: nothing to roll back")
        target = (await decisions.entry(command.version, adapter) if command.version is not None
                  else last_good(await decisions.registry.versions(adapter=adapter), besides=current.version)
                  or await decisions.entry(0, adapter))
        if target.version == current.version:
            raise ValueError(f"{current.id} serves: roll back to another version")
        await decisions.registry.put(move(current, "rolled_back", said, "operator"))
        await decisions.serve(target, said, "operator")
        await decisions.direct_trainer(target, current.version, f"{current.id} rolled back by {command.operator}")
        return f"{current.id} rolled back; {target.id} serves"
    entry = await decisions.entry(_version(command), adapter)
    if entry.version != (await decisions.serving_adapter(adapter)).version:  # the start's entry always says serving
        await decisions.serve(entry, said, "operator")
    if command.kind == "pin":
        await decisions.set_routing(await decisions.routing(), said, pinned_adapters=sorted({*pinned, adapter}))
        return f"{entry.id} serves, pinned"
    return f"{entry.id} serves"


def _version(command: VersionCommand) -> int:
    if command.version is None:
        raise ValueError(f"{command.kind} needs a version")
    return command.version
