"""One flock per rank: a second daemon for the same rank fails fast.

The lock file ``rank<N>.lock`` sits beside the socket. Holding it proves no
other live daemon serves that rank *through this file*. A temp-file cleaner
can delete the file under a live daemon (systemd-tmpfiles ages /tmp; logind
removes /run/user at logout: field case r10), after which a newcomer would
create a fresh file and lock it. So the lock alone never makes a socket
stale: :meth:`RankLock.acquire` also refuses while something answers on the
rank's socket, and the live daemon re-creates its lock file
(:meth:`RankLock.reclaim`, driven by ``preload.daemon.home``).

The lock is taken before any loading, so a duplicate daemon fails in
milliseconds and never touches the first one's socket. A daemon removes
only the lock file it created, checked by inode.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from pgbase.errors import PreloadGateError
from pgbase.lockfile import LockFileError, open_lock_file
from pgbase.oscause import BUSY, FILE_LIMIT_ERRNOS, connect_cause


class RankBusyError(PreloadGateError):
    """Another live daemon already serves this rank of this digest."""


def lock_path(directory: str | os.PathLike[str], global_rank: int) -> Path:
    return Path(directory) / f"rank{global_rank}.lock"


def socket_answers(path: str | os.PathLike[str], timeout_s: float = 1.0) -> bool:
    """True when a process accepts connections on the AF_UNIX socket ``path``.

    A socket file whose daemon died refuses connections (ECONNREFUSED); a
    live daemon's listener accepts them, or, busy, has its listen backlog
    full: a timed connect then fails at once with EAGAIN, and that daemon is
    alive (:func:`pgbase.oscause.connect_cause`). Taken for stale, its
    socket would be unlinked by a second daemon starting on the rank.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(os.fspath(path))
        except OSError as exc:
            return connect_cause(exc, path).kind == BUSY
        return True


def lock_holder(directory: str | os.PathLike[str], global_rank: int) -> str | None:
    """The pid written in the rank's lock file when a live process holds it; None when free or absent."""
    try:
        fd = os.open(lock_path(directory, global_rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in FILE_LIMIT_ERRNOS:
            raise  # not "free": a held rank would read as free
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _busy(directory: str | os.PathLike[str], global_rank: int, holder: str) -> RankBusyError:
    return RankBusyError(
        f"another daemon (pid {holder}) already serves rank {global_rank} in {directory}; "
        "stop it first (preload-gate status lists it)"
    )


class RankLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @property
    def inode(self) -> tuple[int, int]:
        """(dev, ino) of the lock file this daemon holds."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], global_rank: int) -> RankLock:
        path = lock_path(directory, global_rank)
        while True:
            fd = open_lock_file(path, f"rank {global_rank} lock")  # a directory or symlink there: one line
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise _busy(directory, global_rank, holder) from None
            # A releasing daemon unlinks the file after we opened it: retry on the new one.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            lock = cls(path, fd)
            # The lock file may be new because a cleaner deleted a live
            # daemon's: the socket answering says that daemon is alive.
            sock = Path(directory) / f"rank{global_rank}.sock"
            if socket_answers(sock):
                lock.release()
                raise RankBusyError(
                    f"a live daemon answers on {sock} (its lock file was removed, e.g. by a temp-file "
                    "cleaner; it re-creates it); not starting a second copy: stop that one first "
                    "(preload-gate status lists it)"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return lock

    def holds_path(self) -> bool:
        """True when ``path`` is still the file this daemon locked (not removed or replaced)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def reclaim(self) -> bool:
        """Make ``path`` a file this daemon holds locked again, after a cleaner
        removed or replaced it. Returns True when it did; raises
        :class:`RankBusyError` when another live process holds the file now
        found there (the caller decides how long to tolerate that)."""
        if self._fd < 0 or self.holds_path():
            return False
        try:
            fd = open_lock_file(self.path, "rank lock")
        except LockFileError as exc:  # replaced by a directory or a symlink: not ours to take back
            raise RankBusyError(f"the lock file this daemon held was replaced: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RankBusyError(f"another process (pid {holder}) holds {self.path}, the lock file this "
                                "daemon held before it was removed") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        old, self._fd = self._fd, fd
        os.close(old)
        return True

    def release(self) -> None:
        """Unlock, and remove the lock file only if it is still the one we hold (by inode)."""
        if self._fd < 0:
            return
        if self.holds_path():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
