"""argparse ``type=`` callables for numeric flags, shared by every verb.

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


def positive_int(value: str) -> int:
    """An integer >= 1 (counts, sizes, workers, jobs)."""
    n = _int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive integer; give 1 or more")
    return n


def nonnegative_int(value: str) -> int:
    """An integer >= 0 (ranks, retries)."""
    n = _int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative; give 0 or more")
    return n


def seed_int(value: str) -> int:
    """A random seed numpy takes: 0 to 2**32 - 1."""
    n = _int(value)
    if not 0 <= n < 2**32:
        raise argparse.ArgumentTypeError(f"{n} is not a seed numpy takes; give 0 to {2**32 - 1}")
    return n


def port(value: str) -> int:
    """A TCP port to bind, 0 (any free one) to 65535."""
    n = _int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a TCP port; give 0-65535")
    return n


def fixed_port(value: str) -> int:
    """A TCP port others connect to, 1 to 65535 (0 names no port)."""
    n = _int(value)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a TCP port; give 1-65535")
    return n


def positive_float(value: str) -> float:
    """A number > 0 (seconds)."""
    x = _float(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{x:g} is not a positive number; give more than 0")
    return x


def nonnegative_float(value: str) -> float:
    """A number >= 0 (tolerances)."""
    x = _float(value)
    if x < 0:
        raise argparse.ArgumentTypeError(f"{x:g} is negative; give 0 or more")
    return x
