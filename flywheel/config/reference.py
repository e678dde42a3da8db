"""The configuration reference, generated from the typed schema: every key with its type, its
default and its docstring, one table per section, as Markdown. `flywheel config --reference`
prints it; `docs/configuration.md` is its output, and a test keeps the two equal."""

from __future__ import annotations

import inspect
import json
import types
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
    of its key: `[]` for a list of sections, `.<name>` for a mapping of names to sections."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        section, _ = _section(arg)
        if section is not None:
            return section, {list: "[]", dict: ".<name>"}.get(origin, "")
    return None, ""


def _name(annotation: Any) -> str:
    """A type as a reader writes it: `int | None`, `list[str]`, `one of ['a', 'b']`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Annotated:
        return _name(args[0])
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_name(arg) for arg in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _type(annotation: Any) -> str:
    return _cell(_name(annotation))


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
