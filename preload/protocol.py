"""The wire between a daemon and an engine: length-prefixed JSON frames.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON (an
object). File descriptors (the shm transport's memfd) travel alongside a
frame with ``SCM_RIGHTS``. Nothing on this wire is ever unpickled: a peer
that got past the socket's uid check can send us data, never code.

Three bounds keep one bad peer from hurting the daemon:

- ``MAX_FRAME_BYTES``: a length above it is refused before anything is read.
- a deadline per message: once a message starts, all of it must arrive
  before the deadline, so a peer trickling one byte a second cannot hold a
  reader (the deadline covers the whole frame, not each ``recv``).
- a schema per command: a msgspec Struct per request (and per reply
  status), so every field's type is checked by msgspec, not by hand; an
  unknown command or field is an error answer naming its path (``$.pid``),
  not a crash. Frames are decoded by ``msgspec.json`` into plain objects only
  after the length bound has been checked; they are encoded by ``json.dumps``
  (ASCII, compact), byte for byte what earlier releases sent
  (tests/unit/test_wire_compat.py holds both directions).

Every request gets one reply, except the notifications (``NOTIFICATIONS``):
``attached``, the engine's report after a get_state, which the daemon never
answers, so reporting costs the engine one send and no round trip. Version 2
added it: a hit is counted when the engine reports its attach, not when the
reply leaves, and a version-1 engine (which never reports) would be counted
as failing every attach, so the handshake refuses it by name.

Socket trust (directory modes, symlinks, peer uid) lives in
``preload.sockets``; the cache key in ``preload.identity.key``.
"""

from __future__ import annotations

import array
import json
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

import msgspec

from pgbase.errors import DaemonBusyError, ProtocolError
from preload.identity.key import PROTOCOL_VERSION

MAX_FRAME_BYTES = 64 << 20
MAX_FDS = 16
DEFAULT_DEADLINE_S = 10.0
_HEADER = struct.Struct(">I")


class _Request(msgspec.Struct, tag_field="cmd", forbid_unknown_fields=True):
    """A request frame; its ``cmd`` is the msgspec tag that picks the Struct."""


class Hello(_Request, tag="hello"):
    protocol: int
    client: str
    # Optional fields: absent is fine, present must have the type (null is not one).
    pid: int | msgspec.UnsetType = msgspec.UNSET


class GetState(_Request, tag="get_state"):
    key: dict[str, Any]  # checked as a WeightCacheKey by the daemon (its own error)
    client: str | msgspec.UnsetType = msgspec.UNSET


class GetMemory(_Request, tag="get_memory"): ...


class Watch(_Request, tag="watch"): ...


class Release(_Request, tag="release"): ...


class Stats(_Request, tag="stats"): ...


class HandOver(_Request, tag="hand_over"):
    """A successor (``preload --take-over``, same digest and rank) asks this
    daemon to hand its arena over through the fd store: the daemon answers
    ``ok`` (its identity: pid, daemon_id), stops accepting and exits without
    taking its arena out of the store (issue 26). ``client`` names the
    successor in the daemon's log."""

    client: str | msgspec.UnsetType = msgspec.UNSET


# Why an engine's attach failed after a get_state answered ok: it could not
# build its model over the tensors, their resident checksums differ, or the
# daemon serves another digest. "closed" is the daemon's own kind: the
# connection closed before any report came (the engine died mid-attach).
AttachFailureKind = Literal["attach", "verify", "digest"]
ATTACH_FAILURE_KINDS: tuple[str, ...] = get_args(AttachFailureKind)
CLOSED_BEFORE_REPORT = "closed"
MAX_DETAIL_CHARS = 2000


class Attached(_Request, tag="attached"):
    """The engine's word on the state it was served last on this connection:
    ``ok`` (its tensors are in use: the daemon counts a hit), or not, with a
    ``kind`` and the engine's reason (``detail``). A notification: the daemon
    never answers it, so it costs the engine one send; a bad one closes the
    connection (an answer would be read as the reply to the next request)."""

    ok: bool
    kind: AttachFailureKind | msgspec.UnsetType = msgspec.UNSET
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.ok != (self.kind is msgspec.UNSET):
            raise ValueError("kind is given exactly when ok is false")


REQUESTS: dict[str, type[_Request]] = {
    str(c.__struct_config__.tag): c for c in (Hello, GetState, GetMemory, Watch, Release, Stats, Attached, HandOver)
}
# Requests the daemon never answers.
NOTIFICATIONS = frozenset({"attached"})


class _Reply(msgspec.Struct, tag_field="status"):
    """A reply's envelope; other fields are the command's own (not checked here)."""


class _Ok(_Reply, tag="ok"): ...


class _Mismatch(_Reply, tag="mismatch"):
    fields: list[str]


class _Error(_Reply, tag="error"):
    error: Any = "no reason given"


class _Busy(_Reply, tag="busy"):
    error: Any = "busy"


@dataclass
class Frame:
    """A decoded frame and the descriptors that came with it."""

    body: dict[str, Any]
    fds: list[int] = field(default_factory=list)


def encode(obj: dict[str, Any]) -> bytes:
    """Header + JSON payload; raises ProtocolError when it exceeds the bound."""
    try:
        payload = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"frame is not JSON-serialisable: {exc}") from exc
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> dict[str, Any]:
    """A frame's payload as a JSON object; ProtocolError for anything else.

    The caller has already bounded ``len(payload)`` by MAX_FRAME_BYTES.
    """
    try:
        return msgspec.json.decode(payload, type=dict[str, Any])
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"frame is not a JSON object ({exc})") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from exc
    except RecursionError as exc:
        # msgspec recurses per nesting level: a few KiB of "[[[[..." would
        # otherwise escape as RecursionError and kill the connection's thread.
        raise ProtocolError("frame nests JSON too deeply") from exc


def send_frame(
    sock: socket.socket,
    obj: dict[str, Any],
    fds: Sequence[int] = (),
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> None:
    """Send one frame; ``fds`` ride with its first byte (SCM_RIGHTS)."""
    data = memoryview(encode(obj))
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} descriptors exceed the limit of {MAX_FDS}")
    end = time.monotonic() + deadline_s
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = 0
    try:
        while sent < len(data):
            sock.settimeout(_remaining(end, "sending a frame"))
            n = sock.sendmsg([data[sent:]], anc) if anc else sock.send(data[sent:])
            anc = []
            sent += n
    except TimeoutError as exc:
        raise ProtocolError(f"peer did not take a frame within {deadline_s:g} s") from exc


def recv_frame(
    sock: socket.socket,
    deadline_s: float = DEFAULT_DEADLINE_S,
    idle_s: float | None = None,
) -> Frame | None:
    """Receive one frame, or None when the peer closed cleanly between frames.

    ``idle_s`` bounds the wait for the first byte (None: wait forever, as a
    server does between requests); ``deadline_s`` bounds the rest of the
    message from its first byte on.
    """
    fds: list[int] = []
    try:
        first = _recv_exact(sock, 1, None if idle_s is None else time.monotonic() + idle_s, fds, allow_eof=True)
        if first is None:
            return None
        end = time.monotonic() + deadline_s
        rest = _recv_exact(sock, _HEADER.size - 1, end, fds)
        assert rest is not None
        (length,) = _HEADER.unpack(first + rest)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        payload = _recv_exact(sock, length, end, fds)
        assert payload is not None
        return Frame(decode(payload), fds)
    except BaseException:
        _close_fds(fds)
        raise


def _remaining(end: float | None, what: str) -> float | None:
    if end is None:
        return None
    left = end - time.monotonic()
    if left <= 0:
        raise ProtocolError(f"deadline passed while {what}")
    return left


def _recv_exact(
    sock: socket.socket, n: int, end: float | None, fds: list[int], allow_eof: bool = False
) -> bytes | None:
    buf = bytearray()
    fd_size = array.array("i").itemsize
    while len(buf) < n:
        try:
            sock.settimeout(_remaining(end, "reading a frame"))
            data, anc, _flags, _addr = sock.recvmsg(n - len(buf), socket.CMSG_SPACE(MAX_FDS * fd_size))
        except TimeoutError as exc:
            raise ProtocolError("deadline passed while reading a frame") from exc
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % fd_size])
                fds.extend(got)
        if _flags & socket.MSG_CTRUNC:
            # The kernel drops descriptors it cannot install (this process at
            # its open-file limit) or that overflow the buffer, and says only this.
            raise ProtocolError(f"descriptors sent with a frame were dropped: {_truncated_why()}")
        if not data:
            if allow_eof and not buf:
                return None
            raise ProtocolError(f"peer closed the connection mid-frame ({len(buf)} of {n} bytes)")
        buf += data
    return bytes(buf)


def _truncated_why() -> str:
    import errno

    from pgbase.limits import open_file_limit, open_files
    from pgbase.oscause import describe

    if open_files() >= open_file_limit()[0]:
        return describe(OSError(errno.EMFILE, "no room to receive descriptors"))
    return f"more than the {MAX_FDS} a frame may carry"


def _close_fds(fds: list[int]) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def check_request(body: dict[str, Any]) -> str:
    """Validate a request against its command's Struct; returns the command.

    ProtocolError names the command and msgspec's path to the field, for
    example: hello: Expected `int`, got `str` - at `$.protocol`.
    """
    cmd = body.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError("request lacks a string 'cmd'")
    if cmd not in REQUESTS:
        raise ProtocolError(f"unknown command {cmd!r} (known: {', '.join(REQUESTS)})")
    try:
        msgspec.convert(body, REQUESTS[cmd])
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{cmd}: {exc}") from exc
    return cmd


def check_reply(body: dict[str, Any], cmd: str) -> dict[str, Any]:
    """Validate a reply's envelope; an ``error`` reply becomes ProtocolError,
    a ``busy`` one (:func:`busy_reply`) DaemonBusyError."""
    status = body.get("status")
    try:
        reply = msgspec.convert(body, _Ok | _Mismatch | _Error | _Busy)
    except msgspec.ValidationError as exc:
        if status == "mismatch":
            raise ProtocolError(f"{cmd}: mismatch reply lacks a list of field names ({exc})") from exc
        raise ProtocolError(f"{cmd}: reply has no valid status (got {status!r})") from exc
    if isinstance(reply, _Error):
        raise ProtocolError(f"daemon refused {cmd}: {reply.error}")
    if isinstance(reply, _Busy):
        raise DaemonBusyError(str(reply.error))
    return body


def attach_report(ok: bool, kind: str | None = None, detail: str = "") -> dict[str, Any]:
    """The body of an :class:`Attached` report (``detail`` cut to MAX_DETAIL_CHARS)."""
    if ok:
        return {"cmd": "attached", "ok": True}
    return {"cmd": "attached", "ok": False, "kind": kind or "attach", "detail": detail[:MAX_DETAIL_CHARS]}


def hello_request(client: str, pid: int | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"cmd": "hello", "protocol": PROTOCOL_VERSION, "client": client}
    if pid is not None:
        req["pid"] = pid
    return req


def check_version(peer_version: Any) -> None:
    """Both sides speak exactly one version; anything else is refused by name."""
    if isinstance(peer_version, bool) or peer_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {peer_version!r} is not {PROTOCOL_VERSION}; "
            "run the daemon and the engine from the same preload-gate release"
        )


def error_reply(message: str) -> dict[str, Any]:
    return {"status": "error", "error": message}


def busy_reply(message: str) -> dict[str, Any]:
    """The answer of a daemon at its connection cap to a newcomer's first
    request: alive, with no room now (the client retries, then raises
    :class:`pgbase.errors.DaemonBusyError`)."""
    return {"status": "busy", "error": message}
