"""The validation every API's request shares: strict bodies, lenient message parts, valid Unicode.

A parameter the gateway does not implement is a 400 naming it, never silently ignored: request
bodies (`Body`, `Strict`) forbid unknown keys. Inside messages it is the other way round
(`Lenient`): clients send their own response objects back in the history (the openai SDK's
`refusal`, `annotations`, `audio`, `function_call`; litellm's `provider_specific_fields`,
`reasoning_content`, `thinking_blocks`; LangChain's block `id`s), so keys a message part does not
define are ignored; they never reach the prompt or the recorded turn.

Every string must be valid Unicode (JSON's `\\ud800` escapes can carry lone surrogates, which no
tokenizer, UTF-8 encoder or bus record takes): `Body` checks the whole request before anything
else and names the first field that is not. `invalid` raises an error about one part of a value;
`by_type` picks a union member by the value's `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator
from pydantic_core import PydanticCustomError


def invalid(at: str, reason: str) -> PydanticCustomError:
    """A validation error about the part `at` (dotted, relative to where it is raised) of the
    value being validated; `flywheel.serve.api.errors` joins `at` onto the location in `param`."""
    return PydanticCustomError("invalid_value", "{reason}", {"reason": reason, "at": at})


def _is_valid_unicode(text: str) -> bool:
    if text.isascii():  # O(1) in CPython
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def all_valid_unicode(value: Any) -> bool:
    """Whether every string in a JSON value, keys included, is valid Unicode. Iterative (a deep
    value cannot exhaust the stack) and cheap: about a microsecond per kilobyte of non-ASCII text."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            if not _is_valid_unicode(node):
                return False
        elif kind is dict:
            if not all(_is_valid_unicode(key) for key in node if type(key) is str):
                return False
            stack.extend(node.values())
        elif kind is list:
            stack.extend(node)
    return True


def first_invalid_string(value: Any) -> tuple[str, bool]:
    """(dotted path, whether it is a key) of the first string in a JSON value that is not valid
    Unicode; the value must hold one (`all_valid_unicode` said so)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str) and not _is_valid_unicode(node):
            return path, False
        if isinstance(node, dict):
            if not all(_is_valid_unicode(key) for key in node if isinstance(key, str)):
                return path, True
            children = [(child, f"{path}.{key}" if path else str(key)) for key, child in node.items()]
        elif isinstance(node, list):
            children = [(child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(node)]
        else:
            continue
        stack.extend(reversed(children))  # depth first, in document order
    raise ValueError("no invalid string in the value")


def by_type(members: dict[str, type[BaseModel]], default: str | None = None) -> Any:
    """A union of models chosen by the value's `type` (`default` when it has none). Members are
    tagged with their class names, which error locations leave out, so a refusal names the
    field (`input.0.content`), not the tag; an unknown `type` is an error at the value."""
    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return members[kind].__name__ if isinstance(kind, str) and kind in members else None

    classes = list(dict.fromkeys(members.values()))
    return Annotated[Union[tuple(Annotated[c, Tag(c.__name__)] for c in classes)], Discriminator(tag)]  # noqa: UP007


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Body(Strict):
    """A request body: before the fields are validated, every string in it (keys included) must
    be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if not all_valid_unicode(value):
            path, is_key = first_invalid_string(value)
            what = "a key" if is_key else "the string"
            raise invalid(path, f"{what} contains a lone surrogate (U+D800 to U+DFFF), which is not valid Unicode")
        return value


class Lenient(BaseModel):
    """A part of a message: keys it does not define are what clients add to their own
    response objects; they are ignored (and not recorded)."""

    model_config = ConfigDict(extra="ignore")


