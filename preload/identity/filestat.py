"""Stats of checkpoint files, issued all at once.

The restart check (:func:`preload.identity.manifest.stale_reason`) compares
one stat per shard with the manifest. On remote storage each stat waits one
round trip, so they are issued concurrently (:func:`stat_all`): N stats
cost about one round trip, not N. Two backends issue them
(``PRELOAD_GATE_STAT_BACKEND``, :func:`stat_backend`): io_uring
(:mod:`preload.identity.uring`: the kernel's threads wait, Python waits
once per 1,024 stats) where the kernel allows it, else the pool of parked
Python threads of :mod:`preload.identity.stat_pool`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pgbase.mounts import filesystem_type, filesystem_type_of_dev
from preload.identity import stat_pool, uring
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

# Engine environment: how stat_all issues its stats: "auto" (default: io_uring
# where the kernel allows it, else the thread pool), "uring" (the same, with a
# warning where it is refused: the operator asked for it), "pool" (threads).
STAT_BACKEND_ENV = "PRELOAD_GATE_STAT_BACKEND"
_BACKENDS = ("auto", "uring", "pool")
_warned: set[str] = set()
_log = logging.getLogger("preload.identity")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _log.warning("preload-gate: %s", message)


def stat_backend(environ: Mapping[str, str] = os.environ) -> str:
    """The backend :func:`stat_all` uses now: ``"uring"`` or ``"pool"``.

    From ``STAT_BACKEND_ENV`` (``auto`` when unset). A value other than
    auto/uring/pool is one warning naming the variable, then ``auto``: the
    check must not fail an engine over a tuning knob's typo. Asking whether
    io_uring is usable sets up this process's ring (once).

    >>> stat_backend({STAT_BACKEND_ENV: "pool"})
    'pool'
    """
    raw = environ.get(STAT_BACKEND_ENV, "").strip().lower() or "auto"
    if raw not in _BACKENDS:
        _warn_once(f"{STAT_BACKEND_ENV}={raw!r} is not one of {', '.join(_BACKENDS)}; using auto")
        raw = "auto"
    if raw == "pool":
        return "pool"
    why = uring.unavailable()
    if why is None:
        return "uring"
    if raw == "uring":
        _warn_once(f"{STAT_BACKEND_ENV}=uring but io_uring is unavailable here ({why}); using the thread pool")
    return "pool"


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

    def changed_fields(self, other: FileStat) -> str:
        """The fields that differ from ``other``, for a message: ``"mtime_ns, ctime_ns"``."""
        return ", ".join(f for f in ("size", "mtime_ns", "ctime_ns", "ino", "dev")
                         if getattr(self, f) != getattr(other, f))


def subdir_stats(checkpoint: str | os.PathLike[str]) -> dict[str, FileStat]:
    """The stat of every folder below ``checkpoint`` (hidden ones too, links
    not followed), keyed by relative POSIX path; see ``Manifest.subdir_stats``."""
    root = Path(checkpoint)
    out: dict[str, FileStat] = {}
    for top, dirs, _ in os.walk(root, followlinks=False):
        for d in dirs:
            p = Path(top, d)
            if not p.is_symlink():
                out[p.relative_to(root).as_posix()] = FileStat.of(p)
    return out


def prestart_stats(n: int) -> threading.Thread | None:
    """Prepare this process for a check of about ``n`` stats, seconds ahead
    (vLLM's plugin registration, :func:`preload.loader.register`): with the
    uring backend set up the ring (and return None), else start ``n`` pool
    workers in the background (:func:`prestart_stat_workers`, its thread).
    Nothing for ``n <= 0``."""
    if n <= 0:
        return None
    if stat_backend() == "uring":
        uring.setup()
        return None
    return stat_pool.prestart_stat_workers(n)


def stat_all(paths: Sequence[str | os.PathLike[str]]) -> list[FileStat | OSError]:
    """``FileStat.of`` every path at once, results in the order of ``paths``.

    Issued all at once (:func:`stat_backend` says how), so N stats on remote
    storage cost about one round trip. A path that cannot be stat'ed is its
    ``OSError`` in the list (the errno and filename ``os.stat`` gives); any
    other exception (a path with a NUL byte: ``ValueError``) is raised here,
    with no stat left in flight. Through io_uring: waves of up to
    ``uring.MAX_ENTRIES`` statx requests, one ``io_uring_enter`` wait each.
    Through the pool: one worker thread per path, at most MAX_STATS_IN_FLIGHT
    in flight (beyond that a worker takes every MAX_STATS_IN_FLIGHT-th path
    in turn), parked and reused (:mod:`preload.identity.stat_pool`).

    >>> [type(r).__name__ for r in stat_all(["/", "/nonexistent"])]
    ['FileStat', 'FileNotFoundError']
    """
    n = len(paths)
    if n == 0:
        return []
    if stat_backend() == "uring":
        encoded = []
        for p in paths:
            raw = os.fsencode(p)  # TypeError for a non-path, as os.stat
            if b"\0" in raw:
                raise ValueError(f"embedded null byte in {p!r}")
            encoded.append(raw)
        try:
            got = uring.statx_many(encoded)
        except OSError as exc:  # the ring failed: this call falls back, whole
            _warn_once(f"stats through io_uring failed ({exc}); this check uses the thread pool")
        else:
            return [FileStat(*r) if isinstance(r, tuple) else OSError(r, os.strerror(r), os.fspath(p))
                    for p, r in zip(paths, got, strict=True)]
    return _stat_all_pooled(paths)


def _stat_all_pooled(paths: Sequence[str | os.PathLike[str]]) -> list[FileStat | OSError]:
    n = len(paths)
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
    "MAX_STATS_IN_FLIGHT", "STAT_BACKEND_ENV", "STAT_BLIND_FILESYSTEMS", "STAT_WORKERS_ENV", "FileStat",
    "filesystem_type", "filesystem_type_of_dev", "prestart_stat_workers", "prestart_stats",
    "start_stat_workers", "stat_all", "stat_backend", "stat_workers_wanted", "stop_stat_workers", "subdir_stats",
]
