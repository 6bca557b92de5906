"""The keeper: one small process per socket root that holds arena fds for
daemons, so the weights outlive a daemon's crash or ``kill -9`` (issue 26).

``python -m preload.daemon.keeper --socket-root R`` listens on
``R/keeper.sock`` (``R`` a private 0700 directory, the socket 0600, every
peer's uid checked with SO_PEERCRED: :mod:`preload.sockets`). Requests are
:mod:`preload.protocol` frames (length-prefixed JSON, fds by SCM_RIGHTS),
one msgspec Struct per command (:class:`Deposit`, :class:`Fetch`,
:class:`ReleaseArena`, :class:`Drop`, :class:`List`, :class:`Hello`); nothing is
unpickled. A bad frame gets an error reply and its connection closed; the
keeper lives on.

What it holds: fds and :class:`~preload.daemon.arena_record.ArenaRecord` s,
nothing else. It never maps an arena, imports no torch and no CUDA (the
test reads its ``/proc/<pid>/maps``), so holding an arena costs it no
memory beyond the kernel's own and it can never write one.

Lifetime of an arena, keyed ``(digest, global_rank)``:

- *held* while the connection that deposited it is open (the daemon lives);
- an *orphan* once that connection closes without ``release`` (a crash,
  ``kill -9``), dropped after the record's ``orphan_ttl_s`` (0: kept until
  ``drop``);
- gone at once on ``release`` by its depositor or ``drop`` (``preload-gate stop``).

Bounds: at most :data:`preload.daemon.fdstore.MAX_ARENAS` arenas (a deposit
past it is refused, a replacement is not), a record of at most
:data:`~preload.daemon.arena_record.MAX_RECORD_BYTES`, at most
:data:`MAX_CONNECTIONS` connections. The keeper exits once it holds nothing
and nobody is connected for ``--idle-s`` seconds, and at once when its
socket is removed (the socket root deleted: nobody could fetch again).

Started by the first daemon that opens the store (:func:`start_keeper`):
in a session of its own (a signal to the daemon's process group does not
reach it), stdin from /dev/null, its log in ``R/keeper.log``; under the
lock file ``R/keeper.lock``, so two daemons racing start one keeper. It
inherits the daemon's environment, so a test's ``$PRELOAD_GATE_OWNERS``
token still ends it with the test (:mod:`pgbase.survivor`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from pgbase.errors import InsecureSocketError, ProtocolError
from preload import protocol
from preload.daemon.arena_record import MAX_ARENAS, MAX_RECORD_BYTES, ArenaRecord
from preload.daemon.keeper_start import (  # noqa: F401  (the keeper's public names, as before the split)
    LOCK_NAME,
    LOG_NAME,
    SOCKET_NAME,
    START_TIMEOUT_S,
    _answers,
    _lock,
    clear_expired,
    note_expired,
    socket_file,
    start_keeper,
    start_lock,
)
from preload.daemon.keeper_wire import (
    _REQUEST,
    COMMANDS,
    Deposit,
    Drop,
    Fetch,
    Hello,
    List,
    ReleaseArena,
    _close_all,
    _Held,
)

log = logging.getLogger("preload.keeper")

MAX_CONNECTIONS = 64
IDLE_S = 5.0  # nothing held, nobody connected, this long: the keeper exits
REAP_S = 0.2  # how often orphans are checked against their TTL

class Keeper:
    """The keeper's state and server (one per socket root)."""

    def __init__(self, root: str | os.PathLike[str], idle_s: float = IDLE_S, max_arenas: int = MAX_ARENAS,
                 reap_s: float = REAP_S) -> None:
        self.root = Path(root)
        self.path = socket_file(root)
        self.idle_s = idle_s
        self.max_arenas = max_arenas
        self.reap_s = reap_s
        self._arenas: dict[tuple[str, int], _Held] = {}
        self._mutex = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._next_conn = 0
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._idle_since = time.monotonic()

    # ------------------------------------------------------------ serving

    def bind(self) -> None:
        """Bind ``<root>/keeper.sock``; a live keeper there is FileExistsError."""
        from preload.sockets import verify_socket
        from preload.trust import ensure_private_dir

        ensure_private_dir(self.root, "socket root")
        if os.path.lexists(self.path):
            verify_socket(self.path)  # a symlink or another user's file: refused by name
            if _answers(self.path):
                raise FileExistsError(f"a keeper already answers on {self.path}")
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        listener.listen(64)
        self._listener = listener

    def serve(self) -> None:
        """Accept until idle (nothing held, nobody connected, ``idle_s``) or stopped."""
        assert self._listener is not None
        last_reap = 0.0
        while not self._stop.is_set():
            r, _, _ = select.select([self._listener], [], [], self.reap_s)
            if r:
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    continue
                self._accept(conn)
            now = time.monotonic()
            if now - last_reap >= self.reap_s:
                self._reap(now)
                last_reap = now
                if not self._socket_is_ours():
                    # Our socket (or the whole root) was removed: no daemon can
                    # reach what we hold any more, so holding it only costs memory.
                    log.warning("keeper: %s is gone or no longer ours; dropping what it held and exiting",
                                self.path)
                    self._stop.set()
                    return
            if self._idle(now) and self._shutdown_if_idle():
                return

    def _idle(self, now: float) -> bool:
        with self._mutex:
            if self._arenas or self._conns:
                self._idle_since = now
                return False
        return now - self._idle_since >= self.idle_s

    def _shutdown_if_idle(self) -> bool:
        """Under the start lock (no daemon is starting a keeper or about to
        reach this one through it), look once more and remove the socket."""
        fd = _lock(self.root)
        try:
            with self._mutex:
                if self._arenas or self._conns:
                    return False
                self._stop.set()
            self._close_listener()
        finally:
            os.close(fd)
        log.info("keeper: nothing held for %.1f s; exiting", self.idle_s)
        return True

    def _socket_is_ours(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self._close_listener()
        with self._mutex:
            for held in self._arenas.values():
                _close_all(held.fds)
            self._arenas.clear()

    def _accept(self, conn: socket.socket) -> None:
        from preload.sockets import verify_peer

        try:
            verify_peer(conn)
        except InsecureSocketError as exc:
            log.warning("keeper: %s", exc)
            conn.close()
            return
        with self._mutex:
            if len(self._conns) >= MAX_CONNECTIONS:
                full = True
            else:
                full = False
                cid = self._next_conn
                self._next_conn += 1
                self._conns[cid] = conn
        if full:
            with contextlib.suppress(OSError, ProtocolError):
                protocol.send_frame(conn, protocol.error_reply(
                    f"the keeper serves at most {MAX_CONNECTIONS} connections"), deadline_s=1.0)
            conn.close()
            return
        threading.Thread(target=self._connection, args=(cid, conn), name=f"keeper-conn{cid}", daemon=True).start()

    def _connection(self, cid: int, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frame = protocol.recv_frame(conn)
                except (ProtocolError, OSError) as exc:
                    # A frame we cannot read leaves no way to find the next one: answer, hang up.
                    with contextlib.suppress(OSError, ProtocolError):
                        protocol.send_frame(conn, protocol.error_reply(f"bad frame: {exc}"), deadline_s=1.0)
                    return
                if frame is None:
                    return
                reply, fds = self._handle(cid, frame)
                try:
                    protocol.send_frame(conn, reply, fds)
                except (ProtocolError, OSError):
                    return
                finally:
                    _close_all(fds)  # our duplicates: the peer got its own copies
        finally:
            self._closed(cid)
            conn.close()

    def _closed(self, cid: int) -> None:
        """A connection ended: what it deposited and did not release becomes an orphan."""
        now = time.monotonic()
        with self._mutex:
            self._conns.pop(cid, None)
            for key, held in self._arenas.items():
                if held.owner == cid:
                    held.owner, held.orphan_since = None, now
                    log.info("keeper: rank %d of %s is an orphan now (its depositor pid %d is gone); "
                             "kept %s", key[1], key[0][:16], held.record.pid,
                             f"{held.record.orphan_ttl_s:g} s" if held.record.orphan_ttl_s else "until dropped")

    def _reap(self, now: float) -> None:
        with self._mutex:
            expired = [k for k, h in self._arenas.items()
                       if h.owner is None and h.record.orphan_ttl_s > 0
                       and now - h.orphan_since >= h.record.orphan_ttl_s]
            for k in expired:
                held = self._arenas.pop(k)
                _close_all(held.fds)
                log.info("keeper: dropped the orphan rank %d of %s after its %g s TTL",
                         k[1], k[0][:16], held.record.orphan_ttl_s)
                # Kept on disk, so a successor says "expired at ..." even after this keeper exits idle.
                note_expired(self.root, k[0], k[1], held.record.orphan_ttl_s)

    # ------------------------------------------------------------ commands

    def _handle(self, cid: int, frame: protocol.Frame) -> tuple[dict[str, Any], list[int]]:
        """One request -> (reply, fds to send with it: duplicates the caller
        closes once sent). Takes the frame's fds."""
        fds = frame.fds
        try:
            cmd = frame.body.get("cmd")
            if cmd not in COMMANDS:
                return protocol.error_reply(f"unknown command {cmd!r} (known: {', '.join(COMMANDS)})"), []
            try:
                req = msgspec.convert(frame.body, _REQUEST)
            except msgspec.ValidationError as exc:
                return protocol.error_reply(f"{cmd}: {exc}"), []
            if isinstance(req, Deposit):
                reply = self._deposit(cid, req, fds)
                fds = []  # kept or closed by _deposit
                return reply, []
            if fds:
                return protocol.error_reply(f"{frame.body.get('cmd')} carries no descriptors; "
                                            f"{len(fds)} came"), []
            if isinstance(req, Hello):
                return {"status": "ok", "pid": os.getpid(), "max_arenas": self.max_arenas}, []
            if isinstance(req, Fetch):
                with self._mutex:
                    held = self._arenas.get((req.digest, req.global_rank))
                    if held is None:
                        return {"status": "ok", "found": False}, []
                    # Duplicated under the mutex: a drop racing the send cannot close them first.
                    return {"status": "ok", "found": True, "record": held.record.to_json(),
                            "held": held.owner is not None}, [os.dup(fd) for fd in held.fds]
            if isinstance(req, ReleaseArena):
                with self._mutex:
                    key = (req.digest, req.global_rank)
                    held = self._arenas.get(key)
                    if held is None or held.owner != cid:
                        return {"status": "ok", "released": 0}, []
                    self._arenas.pop(key)
                _close_all(held.fds)
                return {"status": "ok", "released": 1}, []
            if isinstance(req, Drop):
                with self._mutex:
                    keys = [k for k in self._arenas
                            if (req.digest is None or k[0] == req.digest)
                            and (req.global_rank is None or k[1] == req.global_rank)]
                    dropped = [self._arenas.pop(k) for k in keys]
                for h in dropped:
                    _close_all(h.fds)
                return {"status": "ok", "dropped": [h.summary() for h in dropped]}, []
            if isinstance(req, List):
                with self._mutex:
                    return {"status": "ok", "arenas": [h.summary() for h in self._arenas.values()]}, []
            raise AssertionError(f"unhandled request {req!r}")
        finally:
            _close_all(fds)

    def _deposit(self, cid: int, req: Deposit, fds: list[int]) -> dict[str, Any]:
        try:
            size = len(msgspec.json.encode(req.record))
            if size > MAX_RECORD_BYTES:
                raise ValueError(f"arena record of {size} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
            record = ArenaRecord.from_json(req.record)
            if record.nfds != len(fds):
                raise ValueError(f"the record says {record.nfds} fds; {len(fds)} came with it")
        except ValueError as exc:
            _close_all(fds)
            return protocol.error_reply(f"deposit refused: {exc}")
        key = (record.digest, record.global_rank)
        with self._mutex:
            old = self._arenas.get(key)
            if old is None and len(self._arenas) >= self.max_arenas:
                _close_all(fds)
                return protocol.error_reply(
                    f"deposit refused: the keeper holds {len(self._arenas)} arenas, its limit "
                    f"(MAX_ARENAS {self.max_arenas}); drop some with `preload-gate stop`")
            self._arenas[key] = _Held(record, list(fds), cid)
        clear_expired(self.root, record.digest, record.global_rank)  # held again: an old expiry is history
        if old is not None:
            _close_all(old.fds)
            log.info("keeper: the deposit of %s rank %d (%s/%s) replaced the arena held for it before (%s/%s)",
                     record.digest[:16], record.global_rank, record.stage, record.transport,
                     old.record.stage, old.record.transport)
        return {"status": "ok", "replaced": old is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m preload.daemon.keeper", allow_abbrev=False,
                                description="hold daemons' arena fds across their restarts (issue 26)")
    p.add_argument("--socket-root", required=True, help="the socket root whose daemons it serves")
    p.add_argument("--idle-s", type=float, default=IDLE_S, help="exit after holding nothing this long")
    p.add_argument("--max-arenas", type=int, default=MAX_ARENAS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    root = os.path.abspath(args.socket_root)
    keeper = Keeper(root, idle_s=args.idle_s, max_arenas=args.max_arenas)
    try:
        keeper.bind()
    except FileExistsError as exc:
        log.info("keeper: %s; this one exits", exc)
        return 0
    except (OSError, InsecureSocketError) as exc:
        print(f"preload-gate keeper: cannot listen under {root}: {exc}", file=sys.stderr)
        return 2
    import signal

    signal.signal(signal.SIGTERM, lambda *_: keeper._stop.set())
    log.info("keeper: serving %s (pid %d)", keeper.path, os.getpid())
    try:
        keeper.serve()
    finally:
        keeper.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
