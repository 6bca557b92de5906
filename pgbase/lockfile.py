"""Lock files: open one only if it is one, and say who holds it.

A lock is ``flock(2)`` on a regular file. What sits at the path may be
something else: a directory, a symlink (``O_NOFOLLOW`` refuses it with a
bare ELOOP), a FIFO (whose open would block). Each used to surface as a
raw ``OSError`` traceback; :func:`open_lock_file` refuses it with one line
naming the path, what it is and the fix.

The holder writes its pid and the time it took the lock into the file
(:func:`record_holder`), so a process that finds the lock taken can say
whom it waits for (:func:`read_holder`) instead of waiting silently.

>>> fd = open_lock_file("/tmp/example.lock", "example lock")  # doctest: +SKIP
>>> fcntl.flock(fd, fcntl.LOCK_EX); record_holder(fd)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import stat
import time

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


def record_holder(fd: int) -> None:
    """Write ``PID EPOCH_SECONDS`` into the lock file just locked through ``fd``."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {time.time():.0f}\n".encode(), 0)


def read_holder(fd: int) -> tuple[str, float | None]:
    """``(pid, since)`` as :func:`record_holder` wrote them: ``"unknown"`` and
    None where the holder has not written yet (or wrote only a pid)."""
    fields = os.pread(fd, 64, 0).decode(errors="replace").split()
    pid = fields[0] if fields and fields[0].isdigit() else "unknown"
    try:
        since = float(fields[1]) if len(fields) > 1 else None
    except ValueError:
        since = None
    return pid, since


__all__ = ["LockFileError", "open_lock_file", "read_holder", "record_holder"]
