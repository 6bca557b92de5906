"""Lock files: open one only if it is one, and say who holds it.

A lock is ``flock(2)`` on a regular file. What sits at the path may be
something else: a directory, a symlink (``O_NOFOLLOW`` refuses it with a
bare ELOOP), a FIFO (whose open would block). Each used to surface as a
raw ``OSError`` traceback; :func:`open_lock_file` refuses it with one line
naming the path, what it is and the fix.

The holder writes its pid, the time it took the lock and what for into the
file (:func:`record_holder`), so a process that finds the lock taken can
say whom it waits for (:func:`read_holder`) instead of waiting silently,
and tell a holder that died (:func:`holder_gone`) from one still at work:
a flock outlives its taker only in a process that inherited the open file
(:func:`open_by` names them).

>>> fd = open_lock_file("/tmp/example.lock", "example lock")  # doctest: +SKIP
>>> fcntl.flock(fd, fcntl.LOCK_EX); record_holder(fd)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import stat
import time
from typing import NamedTuple

from pgbase.errors import PreloadGateError


class LockFileError(PreloadGateError):
    """What sits at a lock file's path is not a regular file."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def _refusal(path: str | os.PathLike[str], what: str, mode: int) -> LockFileError:
    return LockFileError(f"{what} {os.fspath(path)} is {_kind(mode)}, not a lock file; "
                         f"remove it (rm -r {os.fspath(path)}) and run again")


def open_lock_file(path: str | os.PathLike[str], what: str, *, create: bool = True) -> int:
    """A descriptor on the lock file ``path`` (created 0600 when ``create``;
    otherwise opened read-only, and a missing file is FileNotFoundError).
    Anything but a regular file there is :class:`LockFileError`, ``what``
    naming the lock in its message ("reference cache lock")."""
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _refusal(path, what, mode) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # opened: a directory read-only, a FIFO
        os.close(fd)
        raise _refusal(path, what, mode)
    return fd


class Holder(NamedTuple):
    """What the holder wrote: its pid (``"unknown"`` before it wrote), since
    when (epoch seconds, None if unknown) and what it holds the lock for
    ("" if it did not say)."""

    pid: str
    since: float | None
    what: str = ""


def record_holder(fd: int, what: str = "") -> None:
    """Write ``PID EPOCH_SECONDS WHAT`` into the lock file just locked through
    ``fd`` (``what``: one line saying for what, e.g. the checkpoint)."""
    line = " ".join(what.split())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {time.time():.0f} {line}".rstrip().encode() + b"\n", 0)


def read_holder(fd: int) -> Holder:
    """The :class:`Holder` :func:`record_holder` wrote."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    fields = text.split(maxsplit=2)
    pid = fields[0] if fields and fields[0].isdigit() else "unknown"
    try:
        since = float(fields[1]) if len(fields) > 1 else None
    except ValueError:
        since = None
    return Holder(pid, since, fields[2].strip() if len(fields) > 2 else "")


def _started(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), from /proc; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat", "rb") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def holder_gone(holder: Holder) -> bool:
    """True when the process that wrote ``holder`` no longer runs: its pid
    is free, or now names a process started after the lock was taken (the
    pid was reused). An unknown pid is not known to be gone."""
    if not holder.pid.isdigit():
        return False
    pid = int(holder.pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive, and not our holder's
        return True
    started = _started(pid)
    # /proc's start time is in clock ticks and btime in whole seconds: 2 s of slack.
    return started is not None and holder.since is not None and started > holder.since + 2


def open_by(path: str | os.PathLike[str]) -> list[int]:
    """The pids of this user's processes that have ``path`` open (read from
    /proc/PID/fd), this process excluded: who can hold a flock on it."""
    target = os.path.realpath(path)
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == target:
                    found.append(int(entry.name))
                    break
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(found)


__all__ = ["Holder", "LockFileError", "holder_gone", "open_by", "open_lock_file", "read_holder", "record_holder"]
