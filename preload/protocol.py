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
- a schema per command: every field's type is checked; an unknown command
  or field is an error answer, not a crash.

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
from typing import Any

from pgbase.errors import ProtocolError
from preload.identity.key import PROTOCOL_VERSION

MAX_FRAME_BYTES = 64 << 20
MAX_FDS = 16
DEFAULT_DEADLINE_S = 10.0
_HEADER = struct.Struct(">I")

# Per command: field -> accepted JSON types. "cmd" is implied.
_INT = (int,)
_STR = (str,)
_OPT_STR = (str, type(None))
REQUESTS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"protocol": _INT, "client": _STR},
    "get_state": {"key": (dict,)},
    "get_memory": {},
    "watch": {},
    "release": {},
    "stats": {},
}
# Optional request fields (absent is fine, present must have this type).
OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"pid": _INT},
    "get_state": {"client": _STR},
}
STATUSES = ("ok", "mismatch", "error")


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
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from exc
    except RecursionError as exc:
        # json.loads recurses per nesting level: a few KiB of "[[[[..." would
        # otherwise escape as RecursionError and kill the connection's thread.
        raise ProtocolError("frame nests JSON too deeply") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


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
        if not data:
            if allow_eof and not buf:
                return None
            raise ProtocolError(f"peer closed the connection mid-frame ({len(buf)} of {n} bytes)")
        buf += data
    return bytes(buf)


def _close_fds(fds: list[int]) -> None:
    import os

    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def check_request(body: dict[str, Any]) -> str:
    """Validate a request against its command's schema; returns the command."""
    cmd = body.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError("request lacks a string 'cmd'")
    if cmd not in REQUESTS:
        raise ProtocolError(f"unknown command {cmd!r} (known: {', '.join(REQUESTS)})")
    required, optional = REQUESTS[cmd], OPTIONAL.get(cmd, {})
    for name, types in required.items():
        if name not in body:
            raise ProtocolError(f"{cmd}: missing field {name!r}")
        _check_type(cmd, name, body[name], types)
    for name, value in body.items():
        if name == "cmd" or name in required:
            continue
        if name not in optional:
            raise ProtocolError(f"{cmd}: unknown field {name!r}")
        _check_type(cmd, name, value, optional[name])
    return cmd


def _check_type(cmd: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int in Python; on this wire it is not.
    if isinstance(value, bool) and bool not in types:
        raise ProtocolError(f"{cmd}: field {name!r} must be {_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise ProtocolError(f"{cmd}: field {name!r} must be {_names(types)}, got {type(value).__name__}")


def _names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def check_reply(body: dict[str, Any], cmd: str) -> dict[str, Any]:
    """Validate a reply's envelope; an ``error`` reply becomes ProtocolError."""
    status = body.get("status")
    if status not in STATUSES:
        raise ProtocolError(f"{cmd}: reply has no valid status (got {status!r})")
    if status == "error":
        raise ProtocolError(f"daemon refused {cmd}: {body.get('error', 'no reason given')}")
    if status == "mismatch" and not (
        isinstance(body.get("fields"), list) and all(isinstance(f, str) for f in body["fields"])
    ):
        raise ProtocolError(f"{cmd}: mismatch reply lacks a list of field names")
    return body


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
