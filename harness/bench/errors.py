"""The bench's one error type, shared by the row registry and its parameters."""

from __future__ import annotations

from pgbase.errors import PreloadGateError


class BenchError(PreloadGateError):
    """A benchmark cannot run as asked (unknown row, bad option, missing tool)."""


__all__ = ["BenchError"]
