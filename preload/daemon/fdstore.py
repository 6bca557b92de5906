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

import os
import select
import socket
import threading
from pathlib import Path
from typing import Any

from pgbase.errors import InsecureSocketError, PreloadGateError, ProtocolError
from preload import protocol
from preload.daemon.arena_record import MAX_ARENAS, ArenaRecord
from preload.daemon.fdstore_base import FdStore, FdStoreError, StoredArena

__all__ = ["MAX_ARENAS", "FdStore", "FdStoreError", "KeeperStore", "StoredArena", "keeper_state", "open_store"]

# MAX_ARENAS: arenas one store holds; a deposit past it is refused (FdStoreError).


class KeeperStore(FdStore):
    """A handle on the keeper of one socket root (:mod:`preload.daemon.keeper`):
    one connection, kept open while this process lives, so what it
    deposits stays *held*; closing it (or this process dying) makes them
    orphans. Thread-safe (one request at a time on the connection).

    Raises :class:`FdStoreError` when the keeper cannot be reached or refuses."""

    name = "keeper"

    def __init__(self, socket_root: str | os.PathLike[str], start: bool = True, client: str = "") -> None:
        from preload.daemon import keeper

        self.root = Path(socket_root)
        self.path = keeper.socket_file(self.root)
        self._mutex = threading.Lock()
        self._sock: socket.socket | None = None
        self.keeper_pid = 0
        self._client = client or f"pid {os.getpid()}"
        for _attempt in range(3):
            if self._connect():
                return
            if not start:
                raise _NoKeeper(f"no keeper answers on {self.path}")
            # Under the start lock: a keeper exiting idle holds it while it
            # removes its socket, and a racing daemon waits here for ours.
            try:
                from preload.trust import ensure_private_dir

                ensure_private_dir(self.root, "socket root")
                with keeper.start_lock(self.root):
                    if self._connect():
                        return
                    keeper.start_keeper(self.root, idle_s=_env_float(KEEPER_IDLE_ENV))
            except (OSError, RuntimeError, PreloadGateError) as exc:
                raise FdStoreError(f"cannot start the keeper under {self.root}: {exc}") from exc
        raise FdStoreError(f"the keeper under {self.root} did not answer a hello after starting it")

    def _connect(self) -> bool:
        """Connect and say hello; False when no keeper answers (or it is leaving)."""
        from preload.sockets import verify_socket

        if not os.path.lexists(self.path):
            return False
        try:
            verify_socket(self.path)
        except InsecureSocketError as exc:
            raise FdStoreError(f"refusing the keeper socket: {exc}") from exc
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.path))
            protocol.send_frame(s, {"cmd": "hello", "client": self._client})
            frame = protocol.recv_frame(s, idle_s=protocol.DEFAULT_DEADLINE_S)
        except (OSError, ProtocolError):
            s.close()
            return False
        if frame is None or frame.body.get("status") != "ok":
            s.close()
            return False
        self.keeper_pid = int(frame.body.get("pid", 0))
        self._sock = s
        return True

    def _ask(self, body: dict[str, Any], fds: list[int] | None = None) -> protocol.Frame:
        with self._mutex:
            if self._sock is None:
                raise FdStoreError("the keeper store handle is closed")
            try:
                protocol.send_frame(self._sock, body, fds or ())
                frame = protocol.recv_frame(self._sock, idle_s=protocol.DEFAULT_DEADLINE_S)
            except (OSError, ProtocolError) as exc:
                raise FdStoreError(f"the keeper on {self.path} failed {body['cmd']}: {exc}") from exc
        if frame is None:
            raise FdStoreError(f"the keeper on {self.path} closed the connection during {body['cmd']}")
        if frame.body.get("status") != "ok":
            _close_fds(frame.fds)
            raise FdStoreError(f"the keeper refused {body['cmd']}: {frame.body.get('error')}")
        return frame

    def deposit(self, record: ArenaRecord, fds: list[int]) -> None:
        if len(fds) != record.nfds:
            raise FdStoreError(f"deposit of {len(fds)} fds under a record that says {record.nfds}")
        self._ask({"cmd": "deposit", "record": record.to_json()}, fds)

    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        frame = self._ask({"cmd": "fetch", "digest": digest, "global_rank": global_rank})
        if not frame.body.get("found"):
            _close_fds(frame.fds)
            return None
        try:
            record = ArenaRecord.from_json(frame.body.get("record"))
        except ValueError as exc:
            _close_fds(frame.fds)
            raise FdStoreError(f"the keeper sent a bad record: {exc}") from exc
        if len(frame.fds) != record.nfds:
            _close_fds(frame.fds)
            raise FdStoreError(f"the keeper sent {len(frame.fds)} fds for a record of {record.nfds}")
        return StoredArena(record, frame.fds, held=bool(frame.body.get("held")))

    def release(self, digest: str, global_rank: int) -> None:
        self._ask({"cmd": "release", "digest": digest, "global_rank": global_rank})

    def drop(self, digest: str | None = None, global_rank: int | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"cmd": "drop"}
        if digest is not None:
            body["digest"] = digest
        if global_rank is not None:
            body["global_rank"] = global_rank
        return list(self._ask(body).body.get("dropped", []))

    def list(self) -> list[dict[str, Any]]:
        return list(self._ask({"cmd": "list"}).body.get("arenas", []))

    def expired(self, digest: str, global_rank: int) -> tuple[float, float] | None:
        from preload.daemon.keeper_start import expired_at

        return expired_at(self.root, digest, global_rank)

    def alive(self) -> bool:
        """The keeper never speaks unasked: a readable connection is its end (EOF)."""
        with self._mutex:
            if self._sock is None:
                return False
            try:
                r, _, _ = select.select([self._sock], [], [], 0)
                return not r or self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self._mutex:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class _NoKeeper(FdStoreError):
    """No keeper runs and none was to be started (``start=False``)."""


KEEPER_IDLE_ENV = "PRELOAD_GATE_KEEPER_IDLE_S"  # how long an empty keeper waits before it exits (tests)
FDSTORE_ENV = "PRELOAD_GATE_FDSTORE"


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise FdStoreError(f"${name}={value!r} is not a number of seconds; unset it or give one") from None


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def keeper_state(socket_root: str | os.PathLike[str]) -> str:
    """``running`` (a keeper answers on ``<root>/keeper.sock``), ``absent``
    (no socket: none was started, or the root was removed) or ``unreachable``
    (its socket is there and nothing answers: the keeper died, e.g. kill -9,
    and what it held with it)."""
    from preload.daemon.keeper_start import _answers, socket_file

    path = socket_file(socket_root)
    if not os.path.lexists(path):
        return "absent"
    return "running" if _answers(path) else "unreachable"


def open_store(socket_root: str | os.PathLike[str] | None, start: bool = True) -> FdStore | None:
    """The store for this process: systemd's when ``$NOTIFY_SOCKET`` and
    ``$PRELOAD_GATE_FDSTORE=systemd`` (set by the shipped unit) say the unit
    keeps fds, else the keeper of ``socket_root`` (started when absent and
    ``start``). None when ``start`` is False and no keeper runs.
    Raises FdStoreError when a store is configured but cannot be used."""
    if os.environ.get(FDSTORE_ENV) == "systemd" and os.environ.get("NOTIFY_SOCKET"):
        from preload.daemon.fdstore_systemd import SystemdStore  # imported only when chosen

        return SystemdStore.from_environment()
    from preload.sockets import default_socket_root

    root = Path(socket_root) if socket_root is not None else default_socket_root()
    try:
        return KeeperStore(root, start=start)
    except _NoKeeper:
        return None
