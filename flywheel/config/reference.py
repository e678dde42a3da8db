"""The configuration reference, generated from the typed schema: every key with its type, its
default and its docstring, one table per section, as Markdown. `flywheel config --reference`
prints it; `docs/configuration.md` is its output, and a test keeps the two equal."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from flywheel.config.schema import FlywheelConfig

INTRO = """# Configuration reference

Generated from the typed schema (`flywheel/config/`) by `flywheel config --reference`; a test keeps
this page equal to it. Every command that runs or reads a deployment takes `--config FILE` (YAML,
one mapping per section) and `key=value` overrides (`train.batch_size=16`, values parsed as YAML);
a key that does not exist, or a value out of range, is an error naming the key. Example files, and
what each is for: [configs/](../configs/README.md).
"""


def _section(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section class a field holds, if it holds one (also `Section | None`), and the suffix
    of its key: `[]` for a list of sections."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, ""
    for arg in typing.get_args(annotation):
        section, _ = _section(arg)
        if section is not None:
            return section, "[]" if typing.get_origin(annotation) is list else ""
    return None, ""


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if inspect.isclass(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return _cell(text.replace("Literal", "one of ").replace("NoneType", "None"))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default if field.default is not PydanticUndefined else field.default_factory()
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """(section key, its description, rows of (key, type, default, description)), depth first."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section, suffix = _section(field.annotation)
        if section is not None and field.default is not None:
            nested.append((key + suffix, section))
        else:
            rows.append((key, _type(field.annotation), _default(field), _cell(field.description)))
    yield prefix.rstrip(".") or "top level", _cell(inspect.getdoc(model) if model.__doc__ else ""), rows
    for key, section in nested:
        yield from sections(section, key + ".")


def reference() -> str:
    parts = [INTRO]
    for key, about, rows in sections(FlywheelConfig):
        if not rows:
            continue
        parts.append(f"## `{key}`\n" if key != "top level" else "## Top level\n")
        if about and key != "top level":
            parts.append(about + "\n")
        parts.append("| key | type | default | what it does |\n|---|---|---|---|")
        parts.extend(f"| `{name}` | {kind} | {default} | {text} |" for name, kind, default, text in rows)
        parts.append("")
    return "\n".join(parts)
