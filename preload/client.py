"""The engine's side of the wire: connect, hello, get_state, attach, watch.

Used by the vLLM loader and by any other consumer (a transformers model
built on the meta device). It trusts a daemon only after the socket checks
in :mod:`preload.sockets`, speaks only JSON frames, and hands the
descriptor to the transport it came from (:func:`preload.transports.transport_for`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgbase.digest_text import parse_digest
from pgbase.errors import (
    CacheKeyMismatchError,
    DaemonBusyError,
    ProtocolError,
    WeightCacheUnavailableError,
)
from pgbase.oscause import BUSY, MISSING, NO_LISTENER, connect_cause, describe
from preload import protocol
from preload.identity.key import WeightCacheKey
from preload.sockets import socket_path, verify_socket
from preload.transports import transport_for
from preload.transports.base import Attachment, Layout, Transport

log = logging.getLogger("preload.client")


@dataclass
class State:
    """A daemon's answer to get_state: where the tensors are and whose they are."""

    layout: Layout
    aliases: dict[str, str]
    descriptor: dict[str, Any]
    fds: list[int]
    digest: str
    daemon_id: str
    stage: str
    key: WeightCacheKey
    # Resident checksums (preload.checksum), sent for arenas engines can write into.
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def transport(self) -> Transport:
        """The transport this state's descriptor came from."""
        return transport_for(self.descriptor)

    def attach(self, *, writable: bool = True) -> Attachment:
        """Map the tensors (takes ownership of ``fds``); ``writable=False``
        for a consumer that never writes them (the transport then maps
        read-only where it can: ``Transport.attach``)."""
        fds, self.fds = self.fds, []
        return self.transport.attach(self.descriptor, fds, self.layout, writable=writable)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


# Between connects to a daemon whose listen backlog is full: short, as the
# backlog drains as fast as the daemon accepts (one accept loop per rank).
_BUSY_RETRY_S = (0.005, 0.05)


def _busy(path: Path, why: str, timeout_s: float) -> DaemonBusyError:
    """What a connect says once a busy daemon (full backlog, or at its connection cap) stayed busy."""
    return DaemonBusyError(f"the daemon at {path} is busy: {why}; connects retried for {timeout_s:g} s; retry, "
                           "connect fewer engines at once, or allow a longer connect timeout")


def _connect(path: Path, timeout_s: float) -> socket.socket:
    """A socket connected to ``path``, each failure worded by its cause
    (:func:`pgbase.oscause.connect_cause`): nothing listening is "no daemon
    answers"; a full listen backlog (EAGAIN: a timed socket connects
    non-blocking, and Linux does not wait for an AF_UNIX backlog then) is
    retried until ``timeout_s``, as a blocking connect would wait, then
    :class:`DaemonBusyError`."""
    end = time.monotonic() + timeout_s
    pause = _BUSY_RETRY_S[0]
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # the engine at its open-file limit: say so, not "no daemon"
            raise WeightCacheUnavailableError(f"cannot connect to the daemon at {path}: {describe(exc)}") from exc
        sock.settimeout(max(end - time.monotonic(), 0.001))
        try:
            sock.connect(str(path))
            sock.settimeout(timeout_s)
            return sock
        except OSError as exc:
            sock.close()
            cause = connect_cause(exc, path)
            if cause.kind != BUSY:
                raise WeightCacheUnavailableError(f"no daemon answers at {path}: {cause.text}" if cause.kind in
                                                  (NO_LISTENER, MISSING) else
                                                  f"cannot connect to the daemon at {path}: {cause.text}") from exc
            left = end - time.monotonic()
            if left <= 0:
                raise _busy(path, cause.text, timeout_s) from exc
            time.sleep(min(pause, left))
            pause = min(pause * 2, _BUSY_RETRY_S[1])


@dataclass
class DaemonClient:
    """One connection to one rank's daemon.

    >>> c = DaemonClient.connect(socket_dir("ab" * 32), 0)  # doctest: +SKIP
    >>> state = c.get_state(key); tensors = state.attach().tensors  # doctest: +SKIP
    """

    sock: socket.socket
    path: Path
    deadline_s: float = protocol.DEFAULT_DEADLINE_S
    hello: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def connect(
        cls,
        directory: str | os.PathLike[str],
        global_rank: int,
        timeout_s: float = 5.0,
        deadline_s: float = 300.0,
        client: str = "preload-gate",
    ) -> DaemonClient:
        path = socket_path(directory, global_rank)
        verify_socket(path)
        end = time.monotonic() + timeout_s
        pause = _BUSY_RETRY_S[0]
        while True:
            sock = _connect(path, max(end - time.monotonic(), 0.001))
            c = cls(sock, path, deadline_s)
            try:
                c.hello = c.request(protocol.hello_request(client, os.getpid()))
                protocol.check_version(c.hello.get("protocol"))
                return c
            except DaemonBusyError as exc:  # at its connection cap: retried as a full backlog is
                c.close()
                left = end - time.monotonic()
                if left <= 0:
                    raise _busy(path, str(exc), timeout_s) from exc
                time.sleep(min(pause, left))
                pause = min(pause * 2, _BUSY_RETRY_S[1] * 4)
            except BaseException:
                c.close()
                raise

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        frame = self._exchange(body)
        for fd in frame.fds:
            os.close(fd)
        return protocol.check_reply(frame.body, str(body["cmd"]))

    def _exchange(self, body: dict[str, Any]) -> protocol.Frame:
        try:
            protocol.send_frame(self.sock, body, (), self.deadline_s)
            frame = protocol.recv_frame(self.sock, self.deadline_s, idle_s=self.deadline_s)
        except OSError as exc:
            raise WeightCacheUnavailableError(f"daemon at {self.path} dropped the connection: {describe(exc)}") from exc
        if frame is None:
            raise WeightCacheUnavailableError(f"daemon at {self.path} closed the connection")
        return frame

    def get_state(self, key: WeightCacheKey) -> State:
        """The daemon's tensors for ``key``; CacheKeyMismatchError names the
        differing fields when it holds another key."""
        frame = self._exchange({"cmd": "get_state", "key": key.to_json()})
        try:
            body = protocol.check_reply(frame.body, "get_state")
            if body["status"] == "mismatch":
                err = CacheKeyMismatchError(body["fields"], f"daemon {self.path} holds another key")
                err.daemon_key = body.get("key")  # type: ignore[attr-defined]
                err.daemon_digest = body.get("digest")  # type: ignore[attr-defined]
                raise err
            try:
                digest = parse_digest(body["digest"], "its digest")  # DigestFormatError is a ValueError
                layout = Layout.from_json(body["entries"], int(body["total_bytes"]))
                daemon_key = WeightCacheKey.from_json(body["key"])
                aliases = {str(k): str(v) for k, v in dict(body.get("aliases") or {}).items()}
                descriptor = dict(body["descriptor"])
                state = State(layout, aliases, descriptor, frame.fds, digest,
                              str(body["daemon_id"]), str(body["stage"]), daemon_key,
                              {str(k): str(v) for k, v in dict(body.get("checksums") or {}).items()})
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"get_state reply is malformed: {exc}") from exc
        except BaseException:
            for fd in frame.fds:
                os.close(fd)
            raise
        # Trust, but verify: the daemon must have matched on every field.
        wrong = key.mismatched_fields(state.key)
        if wrong:
            state.close()
            raise ProtocolError(f"daemon answered ok for a different key (fields: {', '.join(wrong)})")
        return state

    def report_attach(self, ok: bool = True, kind: str | None = None, detail: str = "") -> bool:
        """Tell the daemon how the state it served last on this connection
        ended: attached (``ok``: it counts a hit) or not (``kind``, one of
        :data:`preload.protocol.ATTACH_FAILURE_KINDS`, and the reason). Every
        get_state answered ok wants one report; a connection that closes
        without it is counted as a failed attach.

        A notification (no reply: one send, no round trip), so it never
        fails a load: False, logged, when it could not be sent.

        >>> state = c.get_state(key); model = build(state.attach()); c.report_attach()  # doctest: +SKIP
        """
        try:
            protocol.send_frame(self.sock, protocol.attach_report(ok, kind, detail), (), self.deadline_s)
        except (OSError, ProtocolError) as exc:
            log.info("preload-gate: could not tell the daemon at %s how the attach ended: %s", self.path, exc)
            return False
        return True

    def get_memory(self) -> int:
        return int(self.request({"cmd": "get_memory"})["bytes"])

    def stats(self) -> dict[str, Any]:
        return self.request({"cmd": "stats"})

    def release(self) -> None:
        self.request({"cmd": "release"})

    def hand_over(self, client: str = "preload-gate") -> dict[str, Any]:
        """Ask the daemon to hand its arena over to a successor through the
        fd store and exit (``preload --take-over``); its reply carries its
        ``pid`` and ``daemon_id``. ProtocolError with the daemon's reason
        when it cannot hand over."""
        return self.request({"cmd": "hand_over", "client": client})

    def close(self) -> None:
        self.sock.close()


class Watch:
    """A held-open ``watch`` connection; ``on_loss`` runs once if it closes
    while we still want it (the daemon died or stopped)."""

    def __init__(self, client: DaemonClient, on_loss: Callable[[], None]) -> None:
        self._client = client
        self._on_loss = on_loss
        self._closing = False
        self.lost = threading.Event()
        client.request({"cmd": "watch"})
        client.sock.settimeout(None)
        self._thread = threading.Thread(target=self._run, name="preload-watch", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, directory: str | os.PathLike[str], global_rank: int, on_loss: Callable[[], None]) -> Watch:
        return cls(DaemonClient.connect(directory, global_rank, client="preload-gate-watch"), on_loss)

    def _run(self) -> None:
        try:
            while True:
                data = self._client.sock.recv(4096)
                if not data:
                    break
        except OSError:
            pass
        if not self._closing:
            self.lost.set()
            try:
                self._on_loss()
            except Exception:  # a callback bug must not kill the engine's thread silently
                log.exception("daemon-loss callback failed")

    def close(self) -> None:
        self._closing = True
        try:
            self._client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._client.close()
