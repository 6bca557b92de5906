"""The fd store's interface: :class:`FdStore`, :class:`StoredArena`,
:class:`FdStoreError` (issue 26). Both stores extend it: the keeper's
(:mod:`preload.daemon.fdstore`) and systemd's
(:mod:`preload.daemon.fdstore_systemd`); :func:`preload.daemon.fdstore.open_store`
picks one. Here so that neither store imports the other's module.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from pgbase.errors import PreloadGateError
from preload.daemon.arena_record import MAX_ARENAS, ArenaRecord

__all__ = ["MAX_ARENAS", "FdStore", "FdStoreError", "StoredArena"]


class FdStoreError(PreloadGateError):
    """The store could not be reached, refused a deposit, or answered badly."""


@dataclass
class StoredArena:
    """One arena fetched from a store: its record and fresh fds (the caller's to close)."""

    record: ArenaRecord
    fds: list[int]
    held: bool = False  # a live depositor still holds it (not an orphan)
    extra: dict[str, Any] = field(default_factory=dict)


class FdStore(abc.ABC):
    """One store handle, opened by a daemon rank or by ``status``/``stop``."""

    name: str = ""  # "keeper" | "systemd"

    @abc.abstractmethod
    def deposit(self, record: ArenaRecord, fds: list[int]) -> None:
        """Keep ``fds`` (duplicated: the caller still owns its own) under
        ``(record.digest, record.global_rank)``, replacing what was there.
        Raises FdStoreError (full, refused, unreachable)."""

    @abc.abstractmethod
    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        """The stored arena for ``digest`` and ``global_rank`` with fresh fds, or None."""

    @abc.abstractmethod
    def release(self, digest: str, global_rank: int) -> None:
        """This depositor is stopping for good: drop what it deposited."""

    @abc.abstractmethod
    def drop(self, digest: str | None = None, global_rank: int | None = None) -> list[dict[str, Any]]:
        """Drop stored arenas (all of ``digest``, one rank, or everything for
        None); returns the summaries of what was dropped."""

    @abc.abstractmethod
    def list(self) -> list[dict[str, Any]]:
        """``ArenaRecord.summary()`` of each stored arena plus ``held`` (bool)."""

    def alive(self) -> bool:
        """Whether the store still keeps what this handle deposited (the
        keeper's connection is open); a store the service manager keeps is."""
        return True

    def expired(self, digest: str, global_rank: int) -> tuple[float, float] | None:
        """After a :meth:`fetch` that found nothing: ``(when, ttl)`` where the
        store dropped that arena at the end of its orphan TTL (unix s, s), else None."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Close this handle (a depositor's arenas become orphans, kept for their TTL)."""
