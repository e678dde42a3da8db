"""Load a `FlywheelConfig` from a YAML file plus `key=value` overrides, validated at start.

    load_config("configs/local.yaml", ["train.batch_size=16", "actor.optimizer.lr=3e-4"])

Override values are parsed as YAML scalars (`true`, `3e-4`, `null`, `[1, 2]`). Every problem is
raised as a `ConfigError` whose message names the offending key, e.g.
`actor.eps_clip: Input should be greater than 0`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flywheel.config.schema import FlywheelConfig


class ConfigError(ValueError):
    """An invalid configuration; the message names the key(s) at fault."""


MOVED = {
    "gconfig": "rollout.sampling",
    **{f"train.{name}": f"actor.{name}" for name in (
        "rl_coef", "opd_coef", "opd_clip", "opd_topk_coef", "turn_reward_coef", "turn_discount", "turn_reward_norm")},
}
"""Keys that moved, old -> new: a configuration that still uses one is told where it went."""


def _moved(tree: dict[str, Any]) -> list[str]:
    found = []
    for old, new in MOVED.items():
        node: Any = tree
        for part in old.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            found.append(f"{old}: moved to {new}")
    return found


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.batch_size=16")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        # Cross-field checks already name their keys; don't prefix them with the section.
        lines.append(message if message.startswith(key + ".") else f"{key}: {message}" if key else message)
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> FlywheelConfig:
    """The validated configuration from an optional YAML file and `key=value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        tree = loaded
    tree = _merge(tree, parse_overrides(overrides or []))
    if moved := _moved(tree):
        raise ConfigError("; ".join(moved))
    try:
        return FlywheelConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def dump_config(config: FlywheelConfig) -> str:
    """The configuration as YAML (what a run records in its run directory)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
