"""The version registry's records: every policy version, its state, and why it is in it.

The registry (`flywheel/versions/registry.py`) keeps one `VersionEntry` per version the trainer announced (of
the shared weights, or of a shared or tenant LoRA adapter: each adapter is a line of its own), the
`Routing` that serving follows (which version serves, which one a share of new sessions tries),
the `TrainerDirective` that tells the trainer what to continue from after a rollback, and the
operators' `VersionCommand`s. The promotion loop (`flywheel/promote/`) is their only writer; the CLI
(`flywheel versions`) and the gateway's admin routes send commands and read.

States and who moves a version between them (`flywheel/promote/states.py` holds the allowed moves):

    candidate    announced by the trainer, not evaluated yet
    evaluating   the gate is comparing it with the serving version on the configured suites
    rejected     the gate found it worse (or it descends from a version that was): never served
    canary       serving a share of new sessions while its online signals are compared
    serving      what every new session gets (one version at a time)
    retired      served, then superseded by a better version; or superseded before evaluation
    rolled_back  served (as canary or to all) and was found worse, or an operator took it back
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from flywheel.bus.records import Record

State = Literal["candidate", "evaluating", "rejected", "canary", "serving", "retired", "rolled_back"]
GOOD_STATES: tuple[State, ...] = ("serving", "retired")
"""States of a version that served everyone and was never found worse: what a rollback returns to."""
ENDED_STATES: tuple[State, ...] = ("rejected", "retired", "rolled_back")
FOUND_WORSE: tuple[State, ...] = ("rejected", "rolled_back")
"""States of a version found worse: what descends from it is rejected (`lineage`) and abandoned."""
IN_PLAY: tuple[State, ...] = ("candidate", "evaluating", "canary")
"""States of a version not decided yet: the trainer's line goes on from it."""


class Transition(msgspec.Struct, kw_only=True):
    """One change of a version's state."""

    state: State
    at: float = msgspec.field(default_factory=time.time)
    reason: str
    """Why, in words a person reads in `deploy.versions show`."""
    by: str
    """What decided: `trainer` (announced), `gate`, `canary`, `lineage`, `operator`, `promoter`."""


class VersionEntry(Record, kw_only=True):
    """One policy version: where its weights are, what made it, what was decided about it.
    Its `id` is `v<version>`, or `<adapter>@v<version>` for a version of a LoRA adapter."""

    version: int
    path: str | None
    """Its checkpoint in the weight store (the adapter store for an adapter's); None for version 0,
    the weights serving started with (an adapter's start: the bare base)."""
    adapter: str | None = None
    """The shared or tenant LoRA adapter this is a version of (`adapters.kind: lora`); versions
    count per adapter, and each adapter's line is promoted on its own. None: the shared weights."""
    parent: int | None = None
    """The version its training continued from (after a rollback: the version rolled back to)."""
    step: int = 0
    """The trainer's step count when it was published."""
    trained_on: dict[str, Any] = msgspec.field(default_factory=dict)
    """What it was trained on since its parent: `samples` (how many), `steps` ([first, last]),
    `sample_digests` (the newest samples', by digest, at most a few hundred; `run_dir/trained.jsonl` has them all)."""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    """The training settings it was made with (learning rate, batch size, objective's weights)."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    """Training metrics at publish time: `reward`, `kl_ref`, `entropy`, `reply_tokens`, ..."""
    state: State = "candidate"
    transitions: list[Transition] = msgspec.field(default_factory=list)
    gate: dict[str, Any] | None = None
    """The gate's report: each suite's and guard's numbers against the serving version, the verdict."""
    waiting: str | None = None
    """Why the gate has not evaluated this candidate yet (a traffic suite short of recorded prompts)."""
    canary: dict[str, Any] | None = None
    """Its canary: when it started, the share, each arm's evidence, the sequential test's state."""
    online: list[list[float]] = msgspec.field(default_factory=list)
    """Its online reward over time: `[bucket start (unix s), sessions, reward sum]` per 15 s
    (`flywheel/promote/evidence.py`)."""
    online_seq: int = 0
    """The stream sequence of the last sample counted in `online` (a sample handed again is not)."""

    def moved(self, state: State, reason: str, by: str) -> "VersionEntry":
        self.state = state
        self.waiting = None
        self.transitions.append(Transition(state=state, reason=reason, by=by))
        return self

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    @property
    def served(self) -> bool:
        """Whether it ever served everyone."""
        return any(t.state == "serving" for t in self.transitions)

    def online_reward(self) -> tuple[int, float | None]:
        """Sessions judged while it sampled them, and their mean reward."""
        sessions = int(sum(row[1] for row in self.online))
        return sessions, (sum(row[2] for row in self.online) / sessions if sessions else None)


def last_good(entries: list[VersionEntry], besides: int | None = None) -> VersionEntry | None:
    """The newest version that served everyone and was never found worse (what a rollback
    returns to), other than `besides`."""
    good = [e for e in entries if e.state in GOOD_STATES and e.served and e.version != besides]
    return max(good, key=lambda e: e.version, default=None)


def abandoned_above(entries: list[VersionEntry], serving: int) -> int:
    """How many of `entries` above `serving` the trainer abandoned: each one that is not on the
    line it goes on with, the line from `serving` to a version still in play (candidate,
    evaluating, canary) with nothing rejected or rolled back in between. A rejection abandons the
    superseded versions below the rejected one too: the trainer continues from `serving`."""
    by_version = {e.version: e for e in entries}

    def line_from(version: int | None) -> list[int]:
        """The versions from `version` down to `serving` (exclusive); none if that line is broken
        (a version on it rejected or rolled back, or it does not lead to `serving`)."""
        line = []
        while version is not None and version > serving:
            entry = by_version.get(version)
            if entry is None or entry.state in FOUND_WORSE:
                return []
            line.append(version)
            version = entry.parent
        return line if version == serving else []

    in_play = [e.version for e in entries if e.version > serving and e.state in IN_PLAY]
    live = {v for version in in_play for v in line_from(version)}
    return sum(1 for e in entries if e.version > serving and e.version not in live)


class Arm(msgspec.Struct, kw_only=True):
    """A version a gateway serves, with where its weights are."""

    version: int
    path: str | None


class Routing(Record, kw_only=True):
    """Which versions serve: `serving` gets every session except the `canary_share` of new ones
    that go to `canary` (sticky: a session stays on the version it started with); likewise each
    shared or tenant adapter's line, `adapters` and `adapter_canaries`. Gateways follow the newest
    one (`flywheel/serve/routing.py`, `flywheel/serve/adapter_loading.py`)."""

    serving: Arm
    canary: Arm | None = None
    canary_share: float = 0.0
    pinned: bool = False
    """An operator pinned `serving`: nothing is promoted automatically until it is unpinned."""
    adapters: dict[str, Arm] = msgspec.field(default_factory=dict)
    """The version of each shared or tenant adapter that passed the gate and serves (one absent:
    none has yet; it serves its start, the bare base)."""
    pinned_adapters: list[str] = msgspec.field(default_factory=list)
    """Adapters an operator pinned: none of their candidates is evaluated until unpinned."""
    adapter_canaries: dict[str, Arm] = msgspec.field(default_factory=dict)
    """The version of a shared or tenant adapter on canary: `canary_share` of the new sessions of
    that adapter go to it."""
    reason: str = ""

    def canary_of(self, adapter: str | None) -> Arm | None:
        """The canary of a line: the shared weights' (None) or `adapter`'s."""
        return self.canary if adapter is None else self.adapter_canaries.get(adapter)

    def serving_version(self, adapter: str | None) -> int:
        """The version that serves a line (an adapter none of whose versions has: 0, its start)."""
        if adapter is None:
            return self.serving.version
        routed = self.adapters.get(adapter)
        return routed.version if routed else 0


class TrainerDirective(Record, kw_only=True):
    """What the trainer continues from after a version was rejected or rolled back: the weights
    of `version` (its path), with a fresh optimizer; versions it trained after `abandon_after`
    (exclusive) and up to the version it was on are abandoned, and samples they sampled are not
    trained. Its `id` is unique per directive: the trainer applies each once.

    `rejected`: the version found worse. The trainer carries a directive out only if its weights
    descend from that version: one that comes late, about a line it had already been sent back
    from (a candidate of the old line rejected by lineage after the trainer moved on), would
    otherwise abandon the new line, the version about to serve included, whose samples it would
    then drop one and all."""

    version: int
    path: str | None
    abandon_after: int
    reason: str
    rejected: int | None = None
    adapter: str | None = None
    """The adapter whose line this is about (its versions); None: the shared weights'."""


CommandKind = Literal["promote", "rollback", "pin", "unpin"]


class VersionCommand(Record, kw_only=True):
    """An operator's request (CLI or admin API), carried out by the promotion loop in order."""

    kind: CommandKind
    version: int | None = None
    """`promote` and `pin`: which version; `rollback`: to which (None: the last good one)."""
    adapter: str | None = None
    """The shared or tenant adapter whose line it is about (None: the shared weights')."""
    reason: str = ""
    operator: str = "cli"


class CommandResult(Record, kw_only=True):
    """What became of a `VersionCommand` (same `id`): done, or refused and why."""

    ok: bool
    message: str


def registry_json(entries: list[VersionEntry], routing: Routing | None,
                  adapters: dict[str, list[VersionEntry]] | None = None) -> dict[str, Any]:
    """The registry as plain JSON (the gateway's `/admin/versions` and `/dashboard.json`): the
    shared weights' versions, and each shared or tenant adapter's."""
    return {"routing": msgspec.to_builtins(routing) if routing else None,
            "versions": [msgspec.to_builtins(e) for e in entries],
            "adapters": {name: [msgspec.to_builtins(e) for e in line] for name, line in (adapters or {}).items()}}
