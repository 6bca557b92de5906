"""content/stat in round trips: the restart check timed behind a slow filesystem.

Two filesystems, two ways of issuing the stats (``preload.identity.filestat``):

- :func:`fuse_trips` (the judged figure where it mounts): a FUSE mirror of
  the checkpoint (:class:`harness.bench.fuse_fs.FuseFS`) answering every
  request after one latency. The kernel sees every stat, whoever issues it,
  so both backends are timed on it: io_uring (a fresh ring per check, set up
  outside the clock as plugin registration does; the kernel's io-wq threads
  are created inside it, as in a restarting engine) and the thread pool,
  prestarted (``PRELOAD_GATE_STAT_WORKERS``) and cold.
- :func:`remote_trips`: :class:`harness.bench.remote_fs.RemoteFS`, which
  patches Python's ``os.stat`` and so sees only the pool's stats: the pool
  is forced there.

Each keeps the process's CPU time per check beside its wall: on a shared
machine the wall stretches with other load, the CPU time much less.
"""

from __future__ import annotations

import _thread
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.bench.fuse_fs import FuseFS
from harness.bench.remote_fs import IOCounts, RemoteFS
from preload.identity import anchors, uring
from preload.identity.filestat import STAT_BACKEND_ENV
from preload.identity.stat_pool import prestart_stat_workers, stop_stat_workers
from preload.promote import promote


@contextmanager
def stat_backend(name: str) -> Iterator[None]:
    """``PRELOAD_GATE_STAT_BACKEND=name`` for a ``with`` block (``stat_all`` reads it per call)."""
    before = os.environ.get(STAT_BACKEND_ENV)
    os.environ[STAT_BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STAT_BACKEND_ENV, None)
        else:
            os.environ[STAT_BACKEND_ENV] = before


def cold_start() -> None:
    """Stop the parked stat workers and wait until their threads are gone.

    A restarting engine is a fresh process: no threads of an earlier check
    are exiting beside its first one. ``stop_stat_workers`` returns once the
    workers left their loops; their thread states and stacks are torn down
    after that, and 1,000 of them doing so inside the next clock cost up to
    0.2 s of CPU here (cold CPU grew 0.20 -> 0.34 -> 0.41 s over three runs).
    """
    stop_stat_workers()
    deadline, last, steady = time.monotonic() + 10, -1, 0
    while steady < 3 and time.monotonic() < deadline:  # thread count stable for 60 ms
        now = _thread._count()
        steady, last = (steady + 1 if now == last else 0), now
        time.sleep(0.02)
    time.sleep(0.2)  # the kernel side of thread exit (stack munmap)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, io-wq's included
    return r.ru_utime + r.ru_stime


def measure(fs_root: Path, latency_s: float, stat_latency_s: float, fn: Callable[[], object]) -> tuple[IOCounts, float]:
    with RemoteFS([fs_root], latency_s=latency_s, stat_latency_s=stat_latency_s) as fs:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    return fs.counts, wall


def _summary(runs: dict[str, list[tuple[float, float]]], trip: float) -> dict:
    """Walls, CPU and median round trips per way of issuing the stats."""
    out: dict = {}
    for way, got in runs.items():
        out[f"{way}_walls_s"] = [round(w, 6) for w, _ in got]
        out[f"{way}_cpu_s"] = [round(c, 6) for _, c in got]
    out["cold_wall_s"] = statistics.median(w for w, _ in runs["cold"])
    out["cold_round_trips"] = out["cold_wall_s"] / trip
    out["pool_round_trips"] = statistics.median(w for w, _ in runs["prestarted"]) / trip
    return out


def remote_trips(ckpt: Path, cache: Path, latency_ms: float, stat_ms: float, repeats: int) -> dict:
    """content/stat on ``ckpt`` under RemoteFS, the pool forced: the median
    wall of ``repeats`` cold starts (workers stopped before each, so the
    call creates its threads) and of as many with the pool prestarted
    beforehand, outside the clock (``prestart_stat_workers``)."""
    def once() -> tuple[IOCounts, float, float]:
        cpu = cpu_s()
        counts, wall = measure(ckpt, latency_ms / 1000, stat_ms / 1000,
                               lambda: anchors.content(ckpt, "stat", cache_dir=cache))
        return counts, wall, cpu_s() - cpu

    runs: dict[str, list[tuple[float, float]]] = {"cold": [], "prestarted": []}
    with stat_backend("pool"):
        for _ in range(repeats):
            cold_start()
            counts, wall, cpu = once()
            runs["cold"].append((wall, cpu))
            pool = prestart_stat_workers(counts.stats, in_forks=False)
            if pool is not None:
                pool.join()
            runs["prestarted"].append(once()[1:])
        stop_stat_workers()
    out = _summary(runs, stat_ms / 1000)
    wall = statistics.median(w for w, _ in runs["prestarted"])
    return {"fs": "remote_fs", "loadavg_1m": round(os.getloadavg()[0], 2), "backend": "pool", "stats": counts.stats, "opens": counts.opens, "wall_s": wall,
            "round_trips": out["pool_round_trips"], **out}


def local_uring_walls(ckpt: Path, cache: Path, repeats: int) -> list[float] | None:
    """content/stat on ``ckpt`` as it is (no shim, no latency) through io_uring,
    a fresh ring set up outside the clock each time; None where io_uring is
    unavailable. Walls in seconds."""
    if uring.unavailable() is not None:
        return None
    walls = []
    with stat_backend("uring"):
        for _ in range(repeats):
            uring.reset()
            uring.setup()
            t0 = time.perf_counter()
            anchors.content(ckpt, "stat", cache_dir=cache)
            walls.append(round(time.perf_counter() - t0, 6))
    uring.reset()
    return walls


def fuse_trips(real: Path, cache: Path, stat_ms: float, repeats: int) -> dict:
    """content/stat through a FUSE mirror of ``real`` answering each request
    after ``stat_ms``: promoted through the mount at 0 ms (so the manifest
    holds the mount's stats), then timed ``repeats`` times each way: io_uring
    (``uring``, the judged figure where the kernel allows it), the pool
    prestarted and the pool cold (as :func:`remote_trips`).

    Raises FuseUnavailableError when the mirror cannot be mounted.
    """
    refused = uring.unavailable()
    runs: dict[str, list[tuple[float, float]]] = {"cold": [], "prestarted": []}
    if refused is None:
        runs["uring"] = []
    server: dict[str, list[float]] = {way: [] for way in runs}
    fs = FuseFS(real)
    with fs as mnt:
        socks = Path(tempfile.mkdtemp(prefix="pg-bs-", dir="/tmp"))
        promote(mnt, socket_root=socks, cache_dir=cache, progress=False)
        shutil.rmtree(socks, ignore_errors=True)
        fs.set_latency(stat_ms / 1000)

        def once(way: str) -> dict[str, int]:
            fs.reset()
            cpu, srv = cpu_s(), fs.server_cpu_s()
            t0 = time.perf_counter()
            anchors.content(mnt, "stat", cache_dir=cache)
            wall = time.perf_counter() - t0
            runs[way].append((wall, cpu_s() - cpu))
            server[way].append(round(fs.server_cpu_s() - srv, 6))
            return fs.counts()

        for _ in range(repeats):
            if refused is None:
                with stat_backend("uring"):
                    uring.reset()  # a fresh ring: no io-wq threads of an earlier check
                    uring.setup()
                    counts = once("uring")
            with stat_backend("pool"):
                cold_start()
                counts = once("cold")
                stats = counts.get("GETATTR", 0) + counts.get("LOOKUP", 0)
                pool = prestart_stat_workers(stats, in_forks=False)
                if pool is not None:
                    pool.join()
                counts = once("prestarted")
        stop_stat_workers()
        uring.reset()
    trip = stat_ms / 1000
    out = _summary(runs, trip)
    judged = "uring" if refused is None else "prestarted"
    wall = statistics.median(w for w, _ in runs[judged])
    if refused is None:
        out["uring_round_trips"] = wall / trip
    return {"fs": "fuse", "loadavg_1m": round(os.getloadavg()[0], 2), "backend": "uring" if refused is None else "pool", "uring_unavailable": refused,
            "stats": counts.get("GETATTR", 0) + counts.get("LOOKUP", 0), "opens": counts.get("OPEN", 0),
            "fuse_counts": counts, "wall_s": wall, "round_trips": wall / trip,
            **{f"{way}_server_cpu_s": cpu for way, cpu in server.items()}, **out}


__all__ = ["cold_start", "cpu_s", "fuse_trips", "local_uring_walls", "measure", "remote_trips", "stat_backend"]
