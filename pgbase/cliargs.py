"""argparse ``type=`` callables for numeric and digest flags, shared by every verb.

A count, a size, a port or a timeout the user types wrong is refused at
parse time, as one usage line naming the flag (argparse prefixes
"argument --flag:"), exit 2, before anything is read or started: a value
that only fails deep in numpy, a thread pool or an engine costs a
traceback, and ``0`` or ``-1`` jobs is silently meaningless.

>>> positive_int("3")
3
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import TypeVar

from pgbase.digest_text import parse_digest
from pgbase.errors import DigestFormatError

N = TypeVar("N", int, float)


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def _float(value: str) -> float:
    try:
        out = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(out):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
    return out


def _flag(name: str, doc: str, parse: Callable[[str], N], ok: Callable[[N], bool], refusal: str) -> Callable[[str], N]:
    """An argparse ``type=``: ``parse`` the text, then refuse a value ``ok``
    rejects with ``refusal`` (a format string given the value)."""

    def convert(value: str) -> N:
        n = parse(value)
        if not ok(n):
            raise argparse.ArgumentTypeError(refusal.format(n))
        return n

    convert.__name__ = convert.__qualname__ = name
    convert.__doc__ = doc
    return convert


positive_int = _flag("positive_int", "An integer >= 1 (counts, sizes, workers, jobs).", _int,
                     lambda n: n >= 1, "{} is not a positive integer; give 1 or more")
nonnegative_int = _flag("nonnegative_int", "An integer >= 0 (ranks, retries).", _int,
                        lambda n: n >= 0, "{} is negative; give 0 or more")
seed_int = _flag("seed_int", "A random seed numpy takes: 0 to 2**32 - 1.", _int,
                 lambda n: 0 <= n < 2**32, f"{{}} is not a seed numpy takes; give 0 to {2**32 - 1}")
port = _flag("port", "A TCP port to bind, 0 (any free one) to 65535.", _int,
             lambda n: 0 <= n <= 65535, "{} is not a TCP port; give 0-65535")
fixed_port = _flag("fixed_port", "A TCP port others connect to, 1 to 65535 (0 names no port).", _int,
                   lambda n: 1 <= n <= 65535, "{} is not a TCP port; give 1-65535")
positive_float = _flag("positive_float", "A number > 0 (seconds).", _float,
                       lambda x: x > 0, "{:g} is not a positive number; give more than 0")
nonnegative_float = _flag("nonnegative_float", "A number >= 0 (tolerances).", _float,
                          lambda x: x >= 0, "{:g} is negative; give 0 or more")


def digest_arg(value: str) -> str:
    """A SHA-256 content digest (``--expect-digest``), lower-cased, by
    :func:`pgbase.digest_text.parse_digest`'s one rule."""
    try:
        return parse_digest(value, "")
    except DigestFormatError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SIZE_MAX = 1 << 40


def size_arg(text: str) -> int:
    """``2G``, ``512M``, ``64K``, ``1T`` (binary units, optional trailing
    B/iB) or a byte count, 1 byte to 1 TiB; ArgumentTypeError otherwise.

    >>> size_arg("2G")
    2147483648
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 2G, 512M, 65536")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    digits = m.group(1)
    # Exact for a byte count (a float loses bytes past 2**53); a fraction goes through float.
    n = int(digits) * scale if "." not in digits else int(float(digits) * scale)
    if n < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} is less than one byte")
    if n > SIZE_MAX:
        raise argparse.ArgumentTypeError(f"size {text!r} is more than 1T")
    return n
