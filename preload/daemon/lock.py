"""One flock per rank: a second daemon for the same rank fails fast.

The lock file ``rank<N>.lock`` sits beside the socket. Holding it proves no
other live daemon serves that rank, so a socket file found at the same time
is stale (its daemon crashed) and may be replaced. The lock is taken before
any loading, so a duplicate daemon fails in milliseconds and never touches
the first one's socket.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from preload.errors import PreloadGateError


class RankBusyError(PreloadGateError):
    """Another live daemon already serves this rank of this digest."""


def lock_path(directory: str | os.PathLike[str], global_rank: int) -> Path:
    return Path(directory) / f"rank{global_rank}.lock"


class RankLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str], global_rank: int) -> RankLock:
        path = lock_path(directory, global_rank)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RankBusyError(
                    f"another daemon (pid {holder}) already serves rank {global_rank} in {directory}; "
                    "stop it first (preload-gate status lists it)"
                ) from None
            # A releasing daemon unlinks the file after we opened it: retry on the new one.
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return cls(path, fd)
            os.close(fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
