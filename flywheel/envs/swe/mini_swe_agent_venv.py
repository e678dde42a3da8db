"""Where mini-swe-agent lives and how to run it: its own virtualenv (`make msa-venv`: `.venv-msa`
beside the `flywheel` package, or `FLYWHEEL_MSA_VENV`; through litellm it pins `openai<3` and
`huggingface-hub<2`, so it cannot share Flywheel's), whether it is there, and the environment its
programs run with (Flywheel importable, quiet, no first-run prompt, no network lookups)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
"""The directory that holds the `flywheel` package (the repository root)."""
MSA_VENV = Path(os.environ.get("FLYWHEEL_MSA_VENV", ROOT / ".venv-msa"))


def msa_available() -> str:
    """'' when mini-swe-agent's venv is usable, else why not."""
    if not (MSA_VENV / "bin" / "mini").exists():
        return f"no {MSA_VENV}/bin/mini: create it with `make msa-venv`"
    return ""


def msa_env(home: Path) -> dict[str, str]:
    """The client's environment: quiet, no first-run prompt, no network lookups, fail fast."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"), "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "TERM": "dumb", "COLUMNS": "160"}
