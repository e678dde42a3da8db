"""Which state changes a version may make, and who may make them.

The promotion loop changes states only through `move`, which refuses a change this table does
not allow, so a version's history (`VersionEntry.transitions`) is always a path through it:

    candidate ─▶ evaluating ─▶ canary ─▶ serving ─▶ retired
        │            │   │        │          │
        │            │   └────────┼──────────┼──▶ serving        (mode gate: no canary)
        ▼            ▼            ▼          ▼
     retired      rejected    rolled_back  rolled_back
    (superseded) (gate, lineage) (or retired: an operator served another)

An operator (`promote`, `rollback`) may also bring any version that has weights back to serving.
An evaluation that could not finish (the evaluation server went away) puts it back to candidate.
"""

from __future__ import annotations

from flywheel.versions.records import State, VersionEntry

AUTOMATIC: dict[State, frozenset[State]] = {
    "candidate": frozenset({"evaluating", "rejected", "retired"}),
    "evaluating": frozenset({"candidate", "rejected", "canary", "serving"}),
    "canary": frozenset({"serving", "rolled_back", "retired"}),
    "serving": frozenset({"retired", "rolled_back"}),
    "rejected": frozenset(),
    "retired": frozenset(),
    "rolled_back": frozenset(),
}
"""The changes the promoter makes by itself."""

OPERATOR: dict[State, frozenset[State]] = {
    state: allowed | ({"serving"} if state != "serving" else {"rolled_back"}) for state, allowed in AUTOMATIC.items()
}
"""An operator may also serve any version (`promote`), and take back the serving one (`rollback`)."""


class IllegalTransition(ValueError):
    pass


def move(entry: VersionEntry, state: State, reason: str, by: str) -> VersionEntry:
    """Put `entry` in `state`, recording why and who decided; refuses a change not allowed."""
    allowed = OPERATOR if by == "operator" else AUTOMATIC
    if state not in allowed[entry.state]:
        raise IllegalTransition(f"{entry.id} cannot go from {entry.state} to {state} ({by}: {reason})")
    return entry.moved(state, reason, by)
