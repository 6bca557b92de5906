"""Starting the keeper (:mod:`preload.daemon.keeper`) and reaching its files:
its socket, its start lock and its log under a socket root. Split from the
keeper's server so that each stays one concern (issue 39).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pgbase.errors import PreloadGateError

SOCKET_NAME = "keeper.sock"
LOCK_NAME = "keeper.lock"
LOG_NAME = "keeper.log"
EXPIRED_NAME = "keeper.expired.json"  # orphans dropped at the end of their TTL (issue 39)
EXPIRED_KEPT = 256  # expiries remembered, oldest forgotten first
START_TIMEOUT_S = 15.0


def socket_file(root: str | os.PathLike[str]) -> Path:
    return Path(root) / SOCKET_NAME


def _answers(path: Path) -> bool:
    """A keeper listens on ``path`` (busy counts: the ranks' own rule)."""
    from preload.daemon.lock import socket_answers

    return socket_answers(path)


def _lock(root: Path) -> int:
    """Take ``<root>/keeper.lock`` (flock, blocking); the caller closes the fd to release it."""
    from pgbase.lockfile import open_lock_file

    fd = open_lock_file(root / LOCK_NAME, "keeper start lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def start_lock(root: str | os.PathLike[str]) -> Any:
    fd = _lock(Path(root))
    try:
        yield
    finally:
        os.close(fd)


def start_keeper(root: str | os.PathLike[str], idle_s: float | None = None) -> int:
    """Start a keeper for ``root`` detached from the caller (own session,
    stdin /dev/null, log in ``<root>/keeper.log``, cwd ``/``) and wait until
    its socket answers; returns its pid. The caller holds :func:`start_lock`.
    Runs the code this process imported (its package directory first on
    ``PYTHONPATH``) with this process's environment otherwise.
    Raises RuntimeError naming the log when it does not come up."""
    from preload.trust import open_own_file

    root = Path(root)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "preload.daemon.keeper", "--socket-root", str(root)]
    if idle_s is not None:
        cmd += ["--idle-s", str(idle_s)]
    logfd = open_own_file(root / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "keeper log")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logfd, stderr=logfd, env=env,
                                cwd="/", start_new_session=True, close_fds=True)
    finally:
        os.close(logfd)
    end = time.monotonic() + START_TIMEOUT_S
    path = socket_file(root)
    while time.monotonic() < end:
        if _answers(path):
            return proc.pid
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"the keeper exited with code {rc} before serving; see {root / LOG_NAME}")
        time.sleep(0.02)
    raise RuntimeError(f"the keeper did not answer on {path} within {START_TIMEOUT_S:g} s; see {root / LOG_NAME}")


def _expiries(root: Path) -> dict[str, list[float]]:
    try:
        with open(root / EXPIRED_NAME, "rb") as f:
            data = msgspec.json.decode(f.read(1 << 20))
    except (OSError, msgspec.DecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_expiries(root: Path, data: dict) -> None:
    """``data`` as ``<root>/keeper.expired.json``, atomically, 0600. Best
    effort: a failure costs only a successor's "expired at"."""
    from preload.trust import open_own_file

    tmp = root / f".{EXPIRED_NAME}.{os.getpid()}"
    try:
        fd = open_own_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "keeper expiries")
        try:
            os.write(fd, msgspec.json.encode(data))
        finally:
            os.close(fd)
        os.replace(tmp, root / EXPIRED_NAME)
    except (OSError, PreloadGateError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def note_expired(root: str | os.PathLike[str], digest: str, global_rank: int, ttl_s: float) -> None:
    """Record that the keeper dropped ``(digest, global_rank)`` at the end of
    its orphan TTL (now): atomically, 0600, in the socket root. Best effort:
    a failure costs only the successor's "expired at" (it then says "no store")."""
    root = Path(root)
    data = _expiries(root)
    data.pop(f"{digest}/{global_rank}", None)
    data[f"{digest}/{global_rank}"] = [time.time(), ttl_s]
    while len(data) > EXPIRED_KEPT:
        data.pop(next(iter(data)))
    _write_expiries(root, data)


def clear_expired(root: str | os.PathLike[str], digest: str, global_rank: int) -> None:
    """Forget that ``(digest, global_rank)`` expired: a new deposit of it makes
    that expiry history, so a later disk read is never blamed on it. Best effort."""
    root = Path(root)
    data = _expiries(root)
    if data.pop(f"{digest}/{global_rank}", None) is None:
        return
    _write_expiries(root, data)


def expired_at(root: str | os.PathLike[str], digest: str, global_rank: int) -> tuple[float, float] | None:
    """``(when, ttl_s)`` the keeper of ``root`` dropped that arena at its TTL's end, else None."""
    entry = _expiries(Path(root)).get(f"{digest}/{global_rank}")
    if not (isinstance(entry, list) and len(entry) == 2):
        return None
    return float(entry[0]), float(entry[1])
