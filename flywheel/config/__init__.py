"""Typed configuration: YAML files plus `key=value` overrides, validated with errors naming keys."""

from flywheel.config.loader import (
    ConfigError,
    dump_config,
    load_config,
    parse_overrides,
)
from flywheel.config.schema import FlywheelConfig

__all__ = ["ConfigError", "FlywheelConfig", "dump_config", "load_config", "parse_overrides"]
