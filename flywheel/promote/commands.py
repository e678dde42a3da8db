"""Operators' commands on the registry (`flywheel versions`, the gateway's admin routes), carried
out by the promotion loop in order, each one's result written back (`CommandResult`).

A command names a line: the shared weights' (no `adapter`), or a shared or tenant adapter's.
- `promote N`: version N serves its line (an adapter's version 0 is its start, the bare base).
- `rollback [N]`: what serves is rolled back, and N serves instead (default: the line's last
  version that served before it; for an adapter, its start when none did). The line's canary is
  rolled back first, if one runs. The trainer is told to continue from what serves now.
- `pin N`: N serves, and no candidate of the line is evaluated until `unpin`.
"""

from __future__ import annotations

from typing import Any

from flywheel.promote.decisions import Decisions
from flywheel.promote.states import move
from flywheel.versions.records import Routing, VersionCommand, last_good


async def carry_out(decisions: Decisions, command: VersionCommand) -> str:
    """Carry out `command`; what was done. LookupError, ValueError or IllegalTransition: refused."""
    adapter, said = command.adapter, f"{command.operator}: {command.reason or command.kind}"
    if adapter is not None and adapter not in await decisions.registry.adapters():
        raise LookupError(f"no adapter {adapter} in the registry")
    routing = await decisions.routing()
    if command.kind == "unpin":
        await decisions.set_routing(routing, said, **_pinned(routing, adapter, False))
        return ("" if adapter is None else f"{adapter} ") + "unpinned: candidates are evaluated again"
    if command.kind == "rollback":
        canary = routing.canary_of(adapter)
        if command.version is None and canary is not None:
            entry = await decisions.entry(canary.version, adapter)
            await decisions.reject(entry, "rolled_back", said, "operator")
            return f"canary {entry.id} rolled back"
        current = await decisions.serving(adapter)
        target = (await decisions.entry(command.version, adapter) if command.version is not None
                  else last_good(await decisions.registry.versions(adapter=adapter), besides=current.version)
                  or (await decisions.entry(0, adapter) if adapter is not None and current.version != 0 else None))
        if target is None:
            raise LookupError(f"no version served before {current.id}: nothing to roll back to")
        if target.version == current.version:
            raise ValueError(f"{current.id} serves: roll back to another version")
        if not (adapter is not None and current.version == 0):  # an adapter's start is no entry of the registry
            await decisions.registry.put(move(current, "rolled_back", said, "operator"))
        await decisions.serve(target, said, "operator")
        await decisions.direct_trainer(target, current.version, f"{current.id} rolled back by {command.operator}")
        return f"{current.id} rolled back; {target.id} serves"
    if command.version is None:
        raise ValueError(f"{command.kind} needs a version")
    entry = await decisions.entry(command.version, adapter)
    if entry.version != (await decisions.serving(adapter)).version:  # an adapter's start always says serving
        await decisions.serve(entry, said, "operator")
    if command.kind == "pin":
        routing = await decisions.routing()
        await decisions.set_routing(routing, said, **_pinned(routing, adapter, True))
        return f"{entry.id} serves, pinned"
    return f"{entry.id} serves"


def _pinned(routing: Routing, adapter: str | None, pinned: bool) -> dict[str, Any]:
    """The routing's change that pins or unpins the line."""
    if adapter is None:
        return {"pinned": pinned}
    others = [a for a in routing.pinned_adapters if a != adapter]
    return {"pinned_adapters": sorted([*others, adapter]) if pinned else others}
