"""Typed arrays for per-token data (ids, logprobs, versions, masks) in bus records.

A turn record carries its whole prompt's token ids, and a trajectory a few thousand tokens of
ids, mask, logprobs and versions. As MessagePack lists these cost one Python object per element
to decode and to build, which dominated the collect and judge loops (bench/collect_judge.py). As
typed arrays they travel as one MessagePack `bin` (little-endian, fixed width) and decode with
one copy: a benchmark turn record (its message text included) decodes in ~10 µs instead of
~28 µs.

In Python they are `array.array` subclasses, so they index, slice, extend, iterate and compare
like lists (an array also equals a list with the same items), and `torch.frombuffer` reads them
without a copy. In JSON (spill files, `flywheel tail`) they are plain lists of numbers, and either
codec also accepts a list where an array is expected, so records written before this layout
still decode.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable
from typing import Any

_BIG_ENDIAN = sys.byteorder == "big"


class _TypedArray(array.array):
    """An `array.array` of one fixed element type, named by its subclass."""

    typecode_of: str = ""

    def __new__(cls, values: Iterable[Any] | bytes = ()):
        if isinstance(values, (bytes, bytearray, memoryview)):
            out = super().__new__(cls, cls.typecode_of)
            out.frombytes(values)
            if _BIG_ENDIAN:
                out.byteswap()
            return out
        return super().__new__(cls, cls.typecode_of, values)

    @classmethod
    def coerce(cls, values: Iterable[Any]) -> "_TypedArray":
        """`values` itself if it already is this kind of array, else a copy as one."""
        return values if type(values) is cls else cls(values)

    def to_wire(self) -> bytes:
        if _BIG_ENDIAN:
            swapped = array.array(self.typecode, self)
            swapped.byteswap()
            return swapped.tobytes()
        return self.tobytes()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()})"

    def __reduce__(self):  # pickles (Ray) as its subclass, not as a plain array
        return type(self), (self.to_wire(),)


class Int32s(_TypedArray):
    """Token ids and weight versions."""

    typecode_of = "i"


class Float64s(_TypedArray):
    """Log-probabilities (float64: exactly what the engine computed)."""

    typecode_of = "d"


class Int8s(_TypedArray):
    """Loss masks."""

    typecode_of = "b"


ARRAY_TYPES = (Int32s, Float64s, Int8s)


def encode_msgpack_hook(obj: Any) -> Any:
    """msgspec `enc_hook` for MessagePack: arrays as raw little-endian bytes."""
    if isinstance(obj, _TypedArray):
        return obj.to_wire()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def encode_json_hook(obj: Any) -> Any:
    """msgspec `enc_hook` for JSON: arrays as lists of numbers, for people."""
    if isinstance(obj, _TypedArray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def decode_hook(kind: type, obj: Any) -> Any:
    """msgspec `dec_hook`: an array from its bytes (MessagePack) or a list (JSON, old records)."""
    if kind not in ARRAY_TYPES:
        raise NotImplementedError(f"no decoder for {kind.__name__}")
    if not isinstance(obj, (bytes, list)):
        raise TypeError(f"expected bytes or a list for {kind.__name__}, got {type(obj).__name__}")
    try:
        return kind(obj)
    except (TypeError, OverflowError, ValueError) as exc:
        raise ValueError(f"not a valid {kind.__name__}: {exc}") from exc
