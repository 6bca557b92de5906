"""Decoded JSON as a typed object, by msgspec.

The one place the tree turns a dict it read (a cache key off the wire,
recorded deployment settings, a launcher's orders to a rank) into its
dataclass. msgspec checks every field against its annotation (an ``int`` is
never a bool, a ``str | None`` never a number) and names the path of what is
wrong (``$.tp_size``), so no reader keeps its own ``isinstance`` chain.

msgspec ignores fields a dataclass does not declare; here they are an
error: a field this release does not know means another release wrote the
object, and half-reading it would compare the wrong things.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


def convert(obj: Any, cls: type[T], what: str, error: Callable[[str], Exception] = ValueError) -> T:
    """``obj`` (decoded JSON) as ``cls``, a dataclass or msgspec Struct.

    Raises ``error`` (ValueError unless given) with one line that starts
    with ``what``: the unknown fields by name, or msgspec's message with the
    field's path. The class's ``__post_init__`` runs (range checks live
    there) and its own exceptions pass through unchanged.

    >>> @dataclasses.dataclass
    ... class Point:
    ...     x: int
    >>> convert({"x": True}, Point, "point")
    Traceback (most recent call last):
    ValueError: point: Expected `int`, got `bool` - at `$.x`
    """
    if isinstance(obj, dict) and dataclasses.is_dataclass(cls):
        unknown = sorted(set(obj) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise error(f"{what}: unknown fields {unknown}")
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise error(f"{what}: {exc}") from exc
