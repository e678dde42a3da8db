"""Which samples made which version: `run_dir/trained.jsonl`, one line per training step.

    {"step": 12, "version": 12, "samples": ["<sample digest>", ...]}

With `adapters.kind: lora` a step writes one line per adapter it trained, with the adapter and
that adapter's version: `{"step": 12, "adapter": "acme", "version": 3, "samples": [...]}`.

Samples are named by their digests (`flywheel.bus.records.sample_digest`), never their ids.

When weights go back to an earlier version (a version the promotion loop rejected or rolled
back, an adapter's version its guard held back), the trainer writes `{"back_to": V}` (with
`"adapter"` for an adapter's): the steps written before it that made versions after V no longer
lead to the weights.

A trainer writes `{"resumed_at_step": N}` when it starts, N being the step of the checkpoint it
continues from (0 without one): the steps after N that an earlier process wrote belong to weights
that no longer lead anywhere (their samples were not acknowledged, and are trained again; a
process killed before its first checkpoint leaves only such steps). `lineage` reads the file the
way it is meant: the steps that made the current weights, each once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO = path.open("a")

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def resumed(self, step: int) -> None:
        self._write({"resumed_at_step": step})

    def trained(self, step: int, version: int, sample_ids: list[str], adapter: str | None = None) -> None:
        self._write({"step": step, **({"adapter": adapter} if adapter else {}), "version": version, "samples": sample_ids})

    def back_to(self, version: int, adapter: str | None = None) -> None:
        """The weights (`adapter`'s, with adapters) are `version`'s again."""
        self._write({"back_to": version, **({"adapter": adapter} if adapter else {})})

    def close(self) -> None:
        self._file.close()


def lineage(path: Path) -> list[dict[str, Any]]:
    """The steps that led to the newest weights, in order."""
    steps: list[dict[str, Any]] = []
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        if "resumed_at_step" in line:
            steps = [s for s in steps if s["step"] <= line["resumed_at_step"]]
        elif "back_to" in line:
            steps = [s for s in steps if s.get("adapter") != line.get("adapter") or s["version"] <= line["back_to"]]
        else:
            steps.append(line)
    return steps
