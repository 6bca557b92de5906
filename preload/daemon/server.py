"""One rank's socket server: trust checks, commands, counters.

A thread per connection, so a slow client never blocks another; every
message after its first byte must arrive within a deadline, so a trickling
peer loses its connection, not the daemon its thread forever. A bad frame
gets an error answer and the connection closed; it never reaches the
daemon's own state.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pgbase.errors import PreloadGateError, ProtocolError
from pgbase.limits import nofile_fix, open_file_limit
from pgbase.oscause import describe
from preload import protocol
from preload.budget import MAX_CONNECTIONS, connection_files, open_file_room
from preload.daemon.counters import RankStats, Session
from preload.daemon.home import HomeWatch, inode_of, remove_if_empty, unlink_if
from preload.daemon.lock import RankBusyError, RankLock, socket_answers
from preload.daemon.stage import Filled
from preload.identity.key import WeightCacheKey
from preload.sockets import ensure_private_dir, socket_path, verify_peer, verify_socket

log = logging.getLogger("preload.daemon")

# How long the accept loop gives a newcomer past the cap to send its first
# request before it is answered busy (or closed): a well-behaved client sends
# its hello at once.
CAP_ANSWER_S = 0.5


class RankServer:
    """Serves one sealed arena on ``<socket_dir>/rank<N>.sock``."""

    def __init__(
        self,
        filled: Filled,
        socket_dir: str | os.PathLike[str],
        global_rank: int,
        lock: RankLock,
        deadline_s: float = protocol.DEFAULT_DEADLINE_S,
        checkpoint: str = "",
    ) -> None:
        self.filled = filled
        self.socket_dir = Path(socket_dir)
        self.global_rank = global_rank
        self.path = socket_path(self.socket_dir, global_rank)
        self.daemon_id = uuid.uuid4().hex
        self.deadline_s = deadline_s
        self.checkpoint = checkpoint
        self.stats = RankStats()
        self.released = False
        # Set (under _mutex) when the arena is closed by release or stop: no
        # reply may carry its descriptors after that.
        self._arena_closed = False
        self._lock = lock
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._started = time.time()
        # The socket file we bound (by inode): stop() removes only that.
        self._sock_inode: tuple[int, int] | None = None
        self._home: HomeWatch | None = None
        self.max_connections = MAX_CONNECTIONS
        self._fd_warned = -1e9
        self._cap_warned = -1e9
        # Called once the arena is released on request (copy mode): the rank
        # drops it from the fd store too, or the store would keep it resident.
        self.on_release: Any = None
        # Called once on a successor's hand_over (``preload --take-over``):
        # the rank stops without taking its arena out of the fd store. None:
        # nothing stored, so nothing to hand over (refused).
        self.on_hand_over: Any = None
        self.handed_over = False
        # The daemon this one took the arena over from (``--take-over``): its pid and daemon_id.
        self.took_over_from: dict[str, Any] | None = None

    @property
    def lock(self) -> RankLock:
        return self._lock

    def socket_inode(self) -> tuple[int, int] | None:
        return self._sock_inode

    def on_home_lost(self, reason: str) -> None:
        """The home watch found another process in our place: stop this
        process the way an operator would (SIGTERM), so the launcher exits
        loudly and nothing stays resident unreachable."""
        import signal

        os.kill(os.getpid(), signal.SIGTERM)

    @property
    def key(self) -> WeightCacheKey:
        return self.filled.key

    def start(self) -> None:
        """Bind (replacing a stale socket: we hold the rank's lock) and serve."""
        ensure_private_dir(self.socket_dir)
        if os.path.lexists(self.path):
            # A symlink or another user's file is tampering: refuse, by name
            # (reliability tests: test_hostile_peers.py). A socket is stale
            # only when nothing answers on it, whatever the lock says: a
            # cleaner may have removed a live daemon's lock file (field case r10).
            verify_socket(self.path)
            if socket_answers(self.path):
                raise RankBusyError(f"a live daemon answers on {self.path}; not replacing it")
            os.unlink(self.path)
            log.warning("replaced a stale socket left by a stopped daemon: %s", self.path)
        self._check_own_frames()
        self._bind()
        self.max_connections = self._connection_cap()
        if HomeWatch.enabled():
            self._home = HomeWatch(self, self.on_home_lost)
            self._home.start()

    def _connection_cap(self) -> int:
        """As many connections as the open-file limit leaves room for (each
        holds its socket and, while a state reply goes out, the arena's
        duplicates), at most MAX_CONNECTIONS; said once when it is fewer."""
        per = connection_files(len(self.filled.arena.fds()))
        room = open_file_room()
        cap = max(1, min(MAX_CONNECTIONS, room // per))
        if cap < MAX_CONNECTIONS:
            log.warning("rank %d: the open-file limit leaves room for %d engine connections at once (of %d; "
                        "each engine holds up to 2): %s", self.global_rank, cap, MAX_CONNECTIONS,
                        nofile_fix(open_file_limit()[0] - room + MAX_CONNECTIONS * per))
        return cap

    def _check_own_frames(self) -> None:
        """Parse a hello and a get_state for the key we serve, through the
        checks every request meets, before the socket exists.

        The key we serve must pass our own wire parser (a daemon whose key
        does not round-trip would answer every engine with a bad-key error);
        and msgspec builds each type's decoder on first use (about 1 ms for
        the key, hello and get_state together, measured by the
        ``attach_load`` row's ``solo_attach_s``), which is paid here, not by
        the first engine to attach.
        """
        key = self.key.to_json()
        for body in (protocol.hello_request("self-check"), {"cmd": "get_state", "key": key},
                     protocol.attach_report(False, "attach", "self-check")):
            protocol.check_request(body)
        try:
            parsed = WeightCacheKey.from_json(key)
        except ValueError as exc:
            parsed, why = None, str(exc)
        else:
            why = "it parses to another key"
        if parsed != self.key:
            raise PreloadGateError(f"rank {self.global_rank}: the key we serve fails our own wire parser ({why}); "
                                   "no engine could attach: report this as a bug")

    def _bind(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._sock_inode = inode_of(self.path)
        # Room in the backlog for as many engines as it serves at once: past
        # it, a timed connect gets EAGAIN and waits out its retries (client._connect).
        listener.listen(MAX_CONNECTIONS)
        listener.settimeout(0.2)
        previous, self._listener = self._listener, listener
        self._thread = threading.Thread(target=self._accept_loop, name=f"rank{self.global_rank}-accept", daemon=True)
        self._thread.start()
        if previous is not None:
            previous.close()  # its accept loop ends; the new one serves

    def rebind(self) -> None:
        """Bind a fresh socket at ``path`` (the old file was removed under us)."""
        self._bind()

    def stop(self) -> None:
        """Stop accepting, drop connections (watchers see the loss), remove the
        socket, release the lock, free the arena."""
        if self._home is not None:
            self._home.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        if self._listener is not None:
            self._listener.close()
        unlink_if(self.path, self._sock_inode)  # only the socket we bound, never a successor's
        with self._mutex:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._lock.release()
        remove_if_empty(self.socket_dir)  # the last rank out leaves nothing behind
        self._close_arena()

    def _close_arena(self) -> None:
        """Close the arena under the mutex, so a state reply either duplicated
        its descriptors before (and sends its own copies) or sees it closed."""
        with self._mutex:
            if self._arena_closed:
                return
            self._arena_closed = True
            self.filled.arena.close()

    def _accept_loop(self) -> None:
        listener = self._listener  # each bound socket has its own loop (rebind)
        assert listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Out of descriptors (others took the room): the engine
                    # waits in the backlog; say why, once a minute, and go on.
                    now = time.monotonic()
                    if now - self._fd_warned > 60:
                        self._fd_warned = now
                        log.warning("rank %d: cannot accept an engine: %s", self.global_rank, describe(exc))
                    self._stop.wait(0.05)
                    continue
                return  # the listener was closed (stop, rebind)
            with self._mutex:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """A newcomer past the cap: its first request answered ``busy``
        (:func:`preload.protocol.busy_reply`), then closed. Closed unanswered,
        the client could only say the daemon dropped it (an operator then
        starts another, or believes it dead). At most CAP_ANSWER_S of the
        accept loop for one that sends nothing."""
        now = time.monotonic()
        if now - self._cap_warned > 60:
            self._cap_warned = now
            log.warning("rank %d: at its cap of %d connections: newcomers are answered busy and retry (start "
                        "fewer engines at once)", self.global_rank, self.max_connections)
        try:
            verify_peer(conn)  # another user's process is told nothing, not even busy
            frame = protocol.recv_frame(conn, CAP_ANSWER_S, idle_s=CAP_ANSWER_S)
            if frame is not None:
                for fd in frame.fds:  # requests never carry descriptors
                    os.close(fd)
                protocol.send_frame(conn, protocol.busy_reply(
                    f"at its cap of {self.max_connections} connections"), (), CAP_ANSWER_S)
        except (OSError, PreloadGateError):
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        session: Session | None = None
        try:
            try:
                verify_peer(conn)
            except PreloadGateError as exc:
                log.warning("%s", exc)
                return
            first = True
            session = Session()
            while not self._stop.is_set():
                try:
                    # A connection that never sends its first request within
                    # the deadline (a leaked socket, a connect-only probe) is
                    # closed: MAX_CONNECTIONS of them would lock every engine
                    # out (reliability tests: test_faults_daemon.py).
                    frame = protocol.recv_frame(conn, self.deadline_s, idle_s=self.deadline_s if first else None)
                    first = False
                except ProtocolError as exc:
                    self._count_bad(exc)
                    self._reply(conn, protocol.error_reply(str(exc)))
                    return
                if frame is None:
                    return
                for fd in frame.fds:  # requests never carry descriptors
                    os.close(fd)
                if not self._handle(conn, frame.body, session):
                    return
        except OSError as exc:
            log.info("rank %d: connection closed: %s", self.global_rank, exc)
            return
        except Exception as exc:
            # A bug must cost one connection, answered and logged, never the
            # thread's silence.
            log.exception("rank %d: request failed", self.global_rank)
            self._reply(conn, protocol.error_reply(f"internal error: {type(exc).__name__}: {exc}"))
            return
        finally:
            with self._mutex:
                self._conns.discard(conn)
                if session is not None:
                    self.stats.count_closed(session)  # what it served and never heard back on
            conn.close()

    def _count_bad(self, exc: Exception) -> None:
        with self._mutex:
            self.stats.bad_frames += 1
        log.warning("rank %d: bad frame: %s", self.global_rank, exc)

    def _reply(self, conn: socket.socket, body: dict[str, Any], fds: list[int] | None = None) -> bool:
        """Send one frame; False (logged) when it did not go out."""
        try:
            protocol.send_frame(conn, body, fds or (), self.deadline_s)
        except (OSError, ProtocolError) as exc:
            log.warning("rank %d: reply %r not sent: %s", self.global_rank, body.get("status"), exc)
            return False
        return True

    def _handle(self, conn: socket.socket, body: dict[str, Any], session: Session) -> bool:
        """Answer one request; False closes the connection."""
        with self._mutex:
            self.stats.requests += 1
        try:
            cmd = protocol.check_request(body)
        except ProtocolError as exc:
            self._count_bad(exc)
            if isinstance(body.get("cmd"), str) and body["cmd"] in protocol.NOTIFICATIONS:
                return False  # never answered: an error reply would read as the next request's
            self._reply(conn, protocol.error_reply(str(exc)))
            return True
        if cmd == "attached":
            with self._mutex:
                problem = self.stats.count_report(session, body)
            if problem:
                self._count_bad(ProtocolError(problem))
            return problem is None
        if cmd == "hello":
            session.client, session.pid = body["client"], body.get("pid")
            try:
                protocol.check_version(body["protocol"])
            except ProtocolError as exc:
                self._reply(conn, protocol.error_reply(str(exc)))
                return False
            self._reply(conn, {"status": "ok", "protocol": protocol.PROTOCOL_VERSION, **self._identity()})
        elif cmd == "get_state":
            self._get_state(conn, body["key"], session)
        elif cmd == "get_memory":
            self._reply(conn, {"status": "ok", "bytes": 0 if self.released else self.filled.layout.total_bytes})
        elif cmd == "stats":
            self._reply(conn, {"status": "ok", **self.snapshot()})
        elif cmd == "release":
            self._release()
            self._reply(conn, {"status": "ok", "released": True})
        elif cmd == "hand_over":
            self._hand_over(conn, body, session)
        elif cmd == "watch":
            self._watch(conn)
            return False
        return True

    def _identity(self) -> dict[str, Any]:
        return {
            "daemon_id": self.daemon_id, "digest": self.filled.digest, "rank": self.global_rank,
            "stage": self.filled.stage, "transport": self.key.transport, "pid": os.getpid(),
            # The GPU (by UUID) a cuda arena lives on: engines pick their GPU's daemon by it.
            "gpu_uuid": self.filled.arena.gpu_uuid,
        }

    def _get_state(self, conn: socket.socket, key_obj: dict[str, Any], session: Session) -> None:
        try:
            key = WeightCacheKey.from_json(key_obj)
        except (ValueError, TypeError) as exc:
            self._count_bad(exc)
            self._reply(conn, protocol.error_reply(f"get_state: bad key: {exc}"))
            return
        fields = self.key.mismatched_fields(key)
        if fields:
            reply = {"status": "mismatch", "fields": fields, "key": self.key.to_json(), **self._identity()}
            if self._reply(conn, reply):
                with self._mutex:
                    self.stats.misses["key_mismatch:" + ",".join(fields)] += 1
            return
        f = self.filled
        with self._mutex:
            # Race-free against release/stop: duplicate the descriptors while
            # the arena is known open, send the duplicates, close them after.
            gone = "released" if self.released else ("stopped" if self._arena_closed else None)
            dups: list[int] = []
            dup_failed: str | None = None
            try:
                for fd in [] if gone else f.arena.fds():
                    dups.append(os.dup(fd))
            except OSError as exc:  # the daemon at its open-file limit: the engine is told why
                for fd in dups:
                    os.close(fd)
                dup_failed = describe(exc)
            # A CUDA export is taken from the live arena too.
            descriptor = None if gone or dup_failed else f.arena.descriptor()
        if dup_failed:
            self._reply(conn, protocol.error_reply(f"the daemon cannot hand out its arena: {dup_failed}"))
            return
        if gone:
            why = ("the arena was released (copy mode); restart the daemon" if gone == "released"
                   else "the daemon is stopping")
            if self._reply(conn, protocol.error_reply(why)):
                with self._mutex:
                    self.stats.misses[gone] += 1
            return
        try:
            reply = {
                "status": "ok", **self._identity(), "entries": f.layout.to_json(),
                "total_bytes": f.layout.total_bytes, "aliases": f.aliases,
                "descriptor": descriptor, "key": self.key.to_json(),
                "checksums": f.checksums,
            }
            sent = self._reply(conn, reply, dups)
        finally:
            for fd in dups:
                os.close(fd)
        if sent:  # served: a hit once the engine reports it attached (preload.daemon.counters)
            with self._mutex:
                self.stats.count_served(session)

    def _watch(self, conn: socket.socket) -> None:
        """Hold the connection open; its close is the daemon-loss signal."""
        # Counted before the answer, so a client that saw "ok" sees itself counted.
        with self._mutex:
            self.stats.attached += 1
        self._reply(conn, {"status": "ok", **self._identity()})
        try:
            while not self._stop.is_set():
                try:
                    if protocol.recv_frame(conn, self.deadline_s) is None:
                        return
                except (ProtocolError, OSError):
                    return
        finally:
            with self._mutex:
                self.stats.attached -= 1

    def _hand_over(self, conn: socket.socket, body: dict[str, Any], session: Session) -> None:
        """A successor takes over (issue 26, ``--take-over``): answer it, then
        let the rank stop without taking its arena out of the fd store.
        Engines attached keep their mappings (their own descriptors)."""
        with self._mutex:
            why = ""
            if self.released:
                why = "its arena was released (copy mode)"
            elif self.handed_over:
                why = "it is already handing over to another successor"
            elif self.on_hand_over is None:
                why = "it keeps no arena in the fd store (--no-fd-store, or the store refused it)"
            if not why:
                self.handed_over = True
        if why:
            self._reply(conn, protocol.error_reply(f"rank {self.global_rank} cannot hand over: {why}; "
                                                   "stop it and start the successor without --take-over"))
            return
        who = body.get("client") or session.client or "a successor"
        log.warning("rank %d: handing the arena over to %s (pid %s) through the fd store; stopping without "
                    "release", self.global_rank, who, session.pid)
        self._reply(conn, {"status": "ok", **self._identity()})
        self.on_hand_over()

    def _release(self) -> None:
        with self._mutex:
            if self.released:
                return
            self.released = True
            self.stats.releases += 1
        self._close_arena()
        log.info("rank %d: arena released on request (copy mode)", self.global_rank)
        if self.on_release is not None:
            self.on_release()

    def snapshot(self) -> dict[str, Any]:
        """The ``stats`` answer: identity, what it holds, the counters
        (:class:`preload.daemon.counters.RankStats`), and where ``status``
        finds the manifest to compare the folder with."""
        from preload.identity.manifest import default_cache_dir

        with self._mutex:
            return {
                **self._identity(),
                "checkpoint": self.checkpoint,
                # What it holds, so a pipeline re-run can tell "same digest and key" from "same digest".
                "key": self.key.to_json(),
                "resident_bytes": 0 if self.released else self.filled.layout.total_bytes,
                "tensors": len(self.filled.layout.entries),
                **self.stats.to_json(), "released": self.released,
                "load_seconds": self.filled.load_seconds, "uptime_s": time.time() - self._started,
                "device_bytes_held": self.filled.device_bytes_held,
                "device_cache_returned": self.filled.device_cache_returned,
                # Where the arena came from (issue 26): disk, or adopted from the fd store
                # (generation: how many daemons served it before), and a take-over's predecessor.
                "origin": self.filled.origin, "generation": self.filled.generation,
                "took_over_from": self.took_over_from,
                # The cache this rank read its manifest from, and the process that started it
                # (stopping that stops every rank of the daemon).
                "cache_dir": str(default_cache_dir()), "launcher_pid": os.getppid(),
            }
