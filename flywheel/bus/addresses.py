"""Where a run's parts say where they are: one file per address in the run directory.

`bus.url` (written by whoever starts the bus: `start_bus`) is how `flywheel tail` and other
operators' tools find the bus; `serve.url` (written by the serve loop once it listens) is this deployment's endpoint;
`judge.url` (written by a `serve.role: judge` server) is the judge's own server, whose weights do
not move, which an `llm` judge and the hint teacher use; `eval.url` (a `serve.role: eval`
server) is where the promotion gate answers its suites with the versions it compares.
"""

from __future__ import annotations

from pathlib import Path

BUS = "bus.url"
SERVE = "serve.url"
JUDGE = "judge.url"
EVAL = "eval.url"


def write_address(run_dir: str | Path, name: str, url: str) -> None:
    """Written whole, then renamed into place: a reader never finds the file empty (one did, and
    called a URL of nothing)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir / f".{name}.partial"
    partial.write_text(url + "\n")
    partial.replace(run_dir / name)


def read_address(run_dir: str | Path, name: str) -> str:
    """The URL a running part wrote; FileNotFoundError saying so when none has."""
    path = Path(run_dir) / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is a Flywheel run using {run_dir}?")
    return path.read_text().strip()
