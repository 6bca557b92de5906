"""Socket directories: where a daemon listens, and why an engine may trust it.

Directories are keyed by content: ``<socket_root>/<digest[:16]>/``, mode
0700. An engine pointed at other content looks in another directory and
finds no daemon, so a wrong hit needs a wrong digest, not a same-looking
header. Inside, one socket per rank: ``rank<global_rank>.sock`` (0600) and
its lock file.

Both sides refuse a path that is a symlink, not owned by the current user,
or group/world accessible; the daemon also checks each peer's uid with
SO_PEERCRED.
"""

from __future__ import annotations

import argparse
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from pgbase.digest_text import SHORT_CHARS, parse_digest, short_digest
from pgbase.errors import InsecureSocketError
from preload import trust

DIGEST_PREFIX = SHORT_CHARS  # a directory is named by a prefix; the full digest is the identity


# Every session of one user must find the same daemons: a login shell, cron,
# `sudo -u`, `docker exec`, a systemd service. $XDG_RUNTIME_DIR exists in
# some of them only (and logind removes it at logout), $TMPDIR differs
# between them, and home directories may be on NFS, where AF_UNIX sockets do
# not work and paths grow long. So the root is fixed per uid, under /tmp, as
# tmux (/tmp/tmux-<uid>) and ssh-agent do: the trust checks
# (ensure_private_dir: a real directory, ours, 0700) refuse one another user
# planted first, and each daemon watches and repairs its home against
# age-based /tmp cleaners (preload.daemon.home). A service with PrivateTmp=
# sees another /tmp: set PRELOAD_GATE_SOCKET_ROOT for it (and its engines).
SOCKET_ROOT_ENV = "PRELOAD_GATE_SOCKET_ROOT"
_TMP = "/tmp"


def default_socket_root() -> Path:
    """``$PRELOAD_GATE_SOCKET_ROOT`` (made absolute), else ``/tmp/preload-gate-<uid>``:
    the same in every session of a user."""
    env = os.environ.get(SOCKET_ROOT_ENV)
    if env:
        return Path(os.path.abspath(env))
    return Path(_TMP) / f"preload-gate-{os.getuid()}"


def socket_root_arg(value: str) -> str:
    """``--socket-root DIR`` as the CLI takes it: made absolute against the
    current directory, once, at the boundary. Every path derived from it is
    printed (ready lines, ``promote``, ``status``, the pipeline's serve
    command) and used by engines started from other directories, where a
    relative ``rel/dir`` names another place.

    Raises ``argparse.ArgumentTypeError`` (one usage line, exit 2) for "".
    """
    if not value:
        raise argparse.ArgumentTypeError("--socket-root needs a directory, got an empty string")
    return os.path.abspath(value)


def legacy_socket_roots() -> list[Path]:
    """Where releases before the fixed root put daemons ($XDG_RUNTIME_DIR, $TMPDIR), if different."""
    out = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        out.append(Path(runtime) / "preload-gate")
    out.append(Path(tempfile.gettempdir()) / f"preload-gate-{os.getuid()}")
    return [p for p in dict.fromkeys(out) if p != default_socket_root()]


def socket_dir(digest: str, root: str | os.PathLike[str] | None = None) -> Path:
    """``<root>/<digest[:16]>``; ``digest`` is read by
    :func:`pgbase.digest_text.parse_digest` (DigestFormatError, a ValueError,
    for anything but 64 hex), so either case names one directory."""
    return Path(root or default_socket_root()) / short_digest(parse_digest(digest, "socket directory digest"))


def socket_path(directory: str | os.PathLike[str], global_rank: int) -> Path:
    return Path(directory) / f"rank{global_rank}.sock"


def ensure_private_dir(directory: str | os.PathLike[str]) -> Path:
    """Create ``directory`` (and a private root above it) as 0700, then verify."""
    return trust.ensure_private_dir(directory, "socket directory", parents=1)


def verify_private_dir(directory: str | os.PathLike[str]) -> None:
    """A real directory, owned by us, with no group or world access
    (the rule :mod:`preload.trust` applies to manifests and caches too)."""
    trust.verify_private_dir(directory, "socket directory")


def verify_socket(path: str | os.PathLike[str]) -> None:
    """The socket and its directory pass the checks above; the socket is ours."""
    p = Path(path)
    verify_private_dir(p.parent)
    try:
        info = os.lstat(p)
    except FileNotFoundError as exc:
        raise InsecureSocketError(f"no daemon socket at {p}") from exc
    if stat.S_ISLNK(info.st_mode):
        raise InsecureSocketError(f"refusing symlinked socket {p}")
    if not stat.S_ISSOCK(info.st_mode):
        raise InsecureSocketError(f"{p} is not a socket")
    if info.st_uid != os.getuid():
        raise InsecureSocketError(f"socket {p} is owned by uid {info.st_uid}, not {os.getuid()}")


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def verify_peer(conn: socket.socket) -> None:
    """Reject a connection whose peer runs as another user."""
    uid = peer_uid(conn)
    if uid != os.getuid():
        raise InsecureSocketError(f"rejecting connection from uid {uid}")
