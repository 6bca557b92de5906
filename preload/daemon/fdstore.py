"""Where a daemon's arena fds outlive the daemon: the fd store (issue 26).

A rank deposits its sealed arena (``Arena.deposit()``: a descriptor and
fds) with an :class:`~preload.daemon.arena_record.ArenaRecord`; a successor
daemon for the same digest and rank fetches them, adopts and proves them
(``Transport.adopt``/``prove``) and serves without reading the checkpoint.

Two stores implement one interface, picked by :func:`open_store`:

- ``systemd``: the service manager's own file descriptor store
  (``sd_notify`` ``FDSTORE=1`` with ``FDNAME=``; fds come back through
  ``LISTEN_FDS``/``LISTEN_FDNAMES`` when the unit restarts; see
  ``sd_pid_notify_with_fds(3)`` and ``systemd.service(5)``
  ``FileDescriptorStoreMax=``), used when the daemon runs under a unit that
  allows it (:mod:`preload.daemon.fdstore_systemd`).
- ``keeper``: otherwise, one small process of ours per socket root that
  holds only fds and records (no CUDA context, no mapping, no model code),
  started by the first daemon that deposits, reached at
  ``<socket root>/keeper.sock`` under the same trust rules as rank sockets
  (private directory, peer uid, JSON frames, no pickle)
  (:mod:`preload.daemon.keeper`).

Lifetime: an arena stays in the store while the depositing store handle is
open (the daemon lives) and, once it is gone without :meth:`FdStore.release`
(a crash, ``kill -9``), for the record's ``orphan_ttl_s``; ``drop`` (``preload-gate stop``)
removes it at once. The store holds at most :data:`MAX_ARENAS` arenas.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from pgbase.errors import PreloadGateError
from preload.daemon.arena_record import ArenaRecord

MAX_ARENAS = 64  # arenas one store holds; a deposit past it is refused (FdStoreError)


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

    @abc.abstractmethod
    def close(self) -> None:
        """Close this handle (a depositor's arenas become orphans, kept for their TTL)."""


def open_store(socket_root: str | None, start: bool = True) -> FdStore | None:
    """The store for this process: systemd's when ``$NOTIFY_SOCKET`` and
    ``$PRELOAD_GATE_FDSTORE=systemd`` (set by the shipped unit) say the unit
    keeps fds, else the keeper of ``socket_root`` (started when absent and
    ``start``). None when ``start`` is False and no keeper runs.
    Raises FdStoreError when a store is configured but cannot be used."""
    raise NotImplementedError("issue 26: keeper and systemd stores are being built")
