"""Stats of checkpoint files, issued all at once.

The restart check (:func:`preload.identity.manifest.stale_reason`) compares
one stat per shard with the manifest. On remote storage each stat waits one
round trip, so they are issued concurrently from parked worker threads
(:func:`stat_all`, on the pool of :mod:`preload.identity.stat_pool`): N
stats cost about one round trip, not N.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from preload.identity import stat_pool
from preload.identity.stat_pool import (
    MAX_STATS_IN_FLIGHT,
    STAT_WORKERS_ENV,
    prestart_stat_workers,
    start_stat_workers,
    stat_workers_wanted,
    stop_stat_workers,
)

# Filesystems whose stat does not see every edit: on tmpfs and ramfs a write
# through a shared mapping (numpy.memmap(mode="r+"), mmap) changes no size,
# mtime or ctime, neither then nor at msync/munmap (shmem has no writeback to
# stamp them), so a stat check there cannot tell edited bytes from promoted
# ones. Disk filesystems stamp mtime/ctime at the first write fault of a clean
# page (page_mkwrite), so an edit after promotion shows.
STAT_BLIND_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})



@dataclass(frozen=True)
class FileStat:
    """The stat fields that tell a file was replaced or edited (ctime
    cannot be set from user space, so an edit that restores mtime shows)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileStat:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)




def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem ``path`` lives on (``"ext4"``, ``"tmpfs"``,
    ``"nfs4"``...): one stat of ``path``, then :func:`filesystem_type_of_dev`.

    >>> filesystem_type("/proc")
    'proc'
    """
    return filesystem_type_of_dev(os.stat(path).st_dev)


def filesystem_type_of_dev(dev: int) -> str:
    """The type of the mounted filesystem whose device is ``dev`` (a stat's
    ``st_dev``), from the kernel's ``/proc/self/mountinfo`` (proc(5): field 3
    is ``major:minor``, the type follows the `` - `` separator). A local read,
    no I/O on that filesystem, so the restart check can ask it about the
    stats it already took. ``""`` when unknown (no /proc, no such mount).
    """
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 3 and fields[2] == want and right.split():
            return right.split()[0]
    return ""


def stat_all(paths: Sequence[str | os.PathLike[str]]) -> list[FileStat | OSError]:
    """``FileStat.of`` every path at once, results in the order of ``paths``.

    One worker thread per path, at most MAX_STATS_IN_FLIGHT in flight (beyond
    that a worker takes every MAX_STATS_IN_FLIGHT-th path in turn), so N
    stats on remote storage cost about one round trip. A path that cannot be
    stat'ed is its ``OSError`` in the list; any other exception (a path with
    a NUL byte: ``ValueError``) is raised here once every stat has returned.
    Workers are parked and reused (:mod:`preload.identity.stat_pool`).

    >>> [type(r).__name__ for r in stat_all(["/", "/nonexistent"])]
    ['FileStat', 'FileNotFoundError']
    """
    n = len(paths)
    if n == 0:
        return []
    width = min(n, MAX_STATS_IN_FLIGHT)
    results: list[FileStat | OSError | None] = [None] * n
    failures: list[BaseException] = []
    left = [width]
    count = threading.Lock()
    done = threading.Lock()
    done.acquire()
    of = FileStat.of

    def stride(first: int) -> Callable[[], None]:
        def job() -> None:
            for i in range(first, n, width):
                try:
                    results[i] = of(paths[i])
                except OSError as exc:
                    results[i] = exc
                except BaseException as exc:  # raised in the caller, not lost in a thread
                    failures.append(exc)
            with count:
                left[0] -= 1
                if left[0] == 0:
                    done.release()

        return job

    stat_pool.run([stride(k) for k in range(width)])
    done.acquire()
    if failures:
        raise failures[0]
    return [r if r is not None else OSError(f"{os.fspath(paths[i])}: not stat'ed") for i, r in enumerate(results)]



__all__ = [
    "MAX_STATS_IN_FLIGHT", "STAT_BLIND_FILESYSTEMS", "STAT_WORKERS_ENV", "FileStat", "filesystem_type",
    "filesystem_type_of_dev", "prestart_stat_workers", "start_stat_workers", "stat_all", "stat_workers_wanted",
    "stop_stat_workers",
]
