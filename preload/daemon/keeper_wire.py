"""What the keeper (:mod:`preload.daemon.keeper`) is asked and what it holds:
one msgspec Struct per command (nothing is unpickled) and :class:`_Held`,
one arena's record and fds with its owner and orphan time. Split from the
keeper's server (issue 39).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from preload.daemon.arena_record import ArenaRecord

_Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_Rank = Annotated[int, msgspec.Meta(ge=0)]


class _Request(msgspec.Struct, tag_field="cmd", forbid_unknown_fields=True):
    """A keeper request; ``cmd`` picks the Struct."""


class Hello(_Request, tag="hello"):
    client: str = ""


class Deposit(_Request, tag="deposit"):
    """Keep the frame's fds under ``record`` (its ``nfds`` must be their count)."""

    record: dict[str, Any]


class Fetch(_Request, tag="fetch"):
    digest: _Hex64
    global_rank: _Rank


class ReleaseArena(_Request, tag="release"):
    """The depositor stops for good: drop what this connection deposited there."""

    digest: _Hex64
    global_rank: _Rank


class Drop(_Request, tag="drop"):
    digest: _Hex64 | None = None
    global_rank: _Rank | None = None


class List(_Request, tag="list"): ...


_REQUEST = Hello | Deposit | Fetch | ReleaseArena | Drop | List
COMMANDS = tuple(str(c.__struct_config__.tag) for c in (Hello, Deposit, Fetch, ReleaseArena, Drop, List))


@dataclass
class _Held:
    record: ArenaRecord
    fds: list[int]
    owner: int | None  # the depositing connection's id; None: an orphan
    orphan_since: float = 0.0  # monotonic

    def summary(self) -> dict[str, Any]:
        """The record's summary, ``held``, its TTL and, for an orphan with a
        TTL, the seconds left (``ttl_left_s``; None: held, or kept until
        dropped): computed here, so ``status`` shows the keeper's own clock."""
        ttl = self.record.orphan_ttl_s
        left = None
        if self.owner is None and ttl > 0:
            left = round(max(0.0, ttl - (time.monotonic() - self.orphan_since)), 3)
        return {**self.record.summary(), "held": self.owner is not None, "orphan_ttl_s": ttl,
                "ttl_left_s": left}


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
