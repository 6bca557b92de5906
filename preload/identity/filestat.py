"""Stats of checkpoint files, issued all at once.

The restart check (:func:`preload.identity.manifest.stale_reason`) compares
one stat per shard with the manifest. On remote storage each stat waits one
round trip, so they are issued concurrently from parked worker threads
(:func:`stat_all`): N stats cost about one round trip, not N.
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Filesystems whose stat does not see every edit: on tmpfs and ramfs a write
# through a shared mapping (numpy.memmap(mode="r+"), mmap) changes no size,
# mtime or ctime, neither then nor at msync/munmap (shmem has no writeback to
# stamp them), so a stat check there cannot tell edited bytes from promoted
# ones. Disk filesystems stamp mtime/ctime at the first write fault of a clean
# page (page_mkwrite), so an edit after promotion shows.
STAT_BLIND_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})

# Stats in flight at once; each waits one round trip on remote storage.
MAX_STATS_IN_FLIGHT = 1024
# A parked stat worker exits after this long without work.
STAT_WORKER_IDLE_S = 30.0


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


class _StatWorkers:
    """Parked threads that run stats, reused by every :func:`stat_all` call
    in this process.

    A stat on remote storage blocks its thread for one round trip, so N
    concurrent stats need N threads. Creating and tearing down a thread per
    stat costs more than the stat's own CPU (an 8 MiB stack mapped and
    unmapped, a thread state built and freed, all under the GIL), and at
    1,000 shards that alone was several round trips. A parked worker is
    woken by releasing its lock. A call takes parked workers first and
    starts threads only for the rest; those park when done and leave after
    ``STAT_WORKER_IDLE_S`` idle, so a one-shot engine process does not keep
    them. Workers are plain ``_thread`` threads: started without waiting
    for each to be scheduled, and never joined at exit. The stack size is
    left at the process default: ``threading.stack_size`` is process-wide
    (another thread starting one meanwhile would get the small stack too),
    and 256 KiB stacks measured no faster here once workers were chained.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Parked workers, most recently parked last (dict: O(1) removal on idle exit).
        self._parked: dict[_StatWorker, None] = {}
        self._alive = 0

    def start(self, n: int, wait_s: float = 10.0) -> int:
        """Start up to ``n`` more workers (at most MAX_STATS_IN_FLIGHT parked in
        all) and return the number parked once they are (or after ``wait_s``)."""
        with self._lock:
            n = max(0, min(n, MAX_STATS_IN_FLIGHT - len(self._parked)))
            target = len(self._parked) + n
        for _ in range(n):
            _StatWorker(self).spawn(None)
        with self._changed:
            self._changed.wait_for(lambda: len(self._parked) >= target, timeout=wait_s)
            return len(self._parked)

    def parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def stop(self, wait_s: float = 10.0) -> int:
        """Make every parked worker exit; return how many are still alive
        (busy ones, or any that did not exit within ``wait_s``)."""
        with self._lock:
            parked = list(self._parked)
            self._parked.clear()
            target = self._alive - len(parked)
        for worker in parked:
            worker.wake(None)
        with self._changed:
            self._changed.wait_for(lambda: self._alive <= target, timeout=wait_s)
            return self._alive

    def born(self) -> None:
        with self._lock:
            self._alive += 1

    def died(self) -> None:
        with self._changed:
            self._alive -= 1
            self._changed.notify_all()

    def run(self, jobs: list[Callable[[], None]]) -> None:
        """Start each job on its own worker (parked ones first, new threads for
        the rest) and return; the jobs report their own completion.

        Parked workers are woken as a chain: each wakes the next before it
        runs its job. Waking them all from here would have every woken
        thread queue for the GIL at once; the chain keeps about one waiting
        at a time, which halved the CPU of 1,000 stats and cut context
        switches from 11 to 3 per stat. New threads are started here, in a
        loop, not chained: a new thread must first be scheduled, and on a
        loaded machine one late link held up every start after it (cold
        walls of 0.3-0.8 s at 1,000 stats against 0.12-0.14 s from the loop).
        If no more threads can be started, the remaining jobs run here, in
        turn: slower, never lost.
        """
        with self._lock:
            taken = [self._parked.popitem()[0] for _ in range(min(len(jobs), len(self._parked)))]
        k = len(taken)

        def link(i: int) -> Callable[[], None]:
            def job() -> None:
                if i + 1 < k:
                    taken[i + 1].wake(link(i + 1))
                jobs[i]()

            return job

        if k:
            taken[0].wake(link(0))
        for i in range(k, len(jobs)):
            try:
                _StatWorker(self).spawn(jobs[i])
            except RuntimeError:  # "can't start new thread"
                for rest in jobs[i:]:
                    rest()
                return

    def park(self, worker: _StatWorker) -> None:
        with self._changed:
            self._parked[worker] = None
            self._changed.notify_all()

    def leave(self, worker: _StatWorker) -> bool:
        """Whether ``worker`` may exit after an idle wait: nobody took it meanwhile."""
        with self._lock:
            return self._parked.pop(worker, False) is None


class _StatWorker:
    """One thread: runs a job, parks in its pool, waits on its own lock for the next."""

    __slots__ = ("_pool", "_wake", "_job")

    def __init__(self, pool: _StatWorkers) -> None:
        self._pool = pool
        self._wake = threading.Lock()
        self._wake.acquire()
        self._job: Callable[[], None] | None = None

    def spawn(self, job: Callable[[], None] | None) -> None:
        self._job = job
        self._pool.born()
        try:
            _thread.start_new_thread(self._loop, ())
        except BaseException:
            self._pool.died()
            raise

    def wake(self, job: Callable[[], None] | None) -> None:
        """Run ``job`` next (None: exit). Only a worker just taken off the
        parked list is woken, so each release matches one acquire in _loop."""
        self._job = job
        self._wake.release()

    def _loop(self) -> None:
        try:
            job = self._job
            while True:
                if job is not None:
                    job()  # never raises: stat_all's jobs keep their errors
                self._pool.park(self)
                if not self._wake.acquire(timeout=STAT_WORKER_IDLE_S):
                    if self._pool.leave(self):
                        return
                    self._wake.acquire()  # taken just as it timed out: the job is on its way
                job, self._job = self._job, None
                if job is None:
                    return  # stopped
        finally:
            self._pool.died()


_workers = _StatWorkers()


def _forget_workers_after_fork() -> None:
    # A forked child has none of its parent's threads; parked entries would hang.
    global _workers
    _workers = _StatWorkers()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


def start_stat_workers(n: int = MAX_STATS_IN_FLIGHT) -> int:
    """Start ``n`` stat workers now (at most MAX_STATS_IN_FLIGHT parked) and
    return how many are parked, so a later :func:`stat_all` wakes parked
    threads instead of creating them.

    For a process that knows it will check a checkpoint of about ``n``
    shards and has idle time first (a daemon at start, a loader at plugin
    registration). Without it the first check starts its own workers; the
    result is the same. Workers that stay idle STAT_WORKER_IDLE_S seconds exit.
    """
    return _workers.start(n)


def stop_stat_workers() -> int:
    """Make the parked stat workers exit now (a process done checking, or a
    benchmark measuring a cold start); returns how many are still busy.
    A later :func:`stat_all` starts new ones."""
    return _workers.stop()


def stat_all(paths: Sequence[str | os.PathLike[str]]) -> list[FileStat | OSError]:
    """``FileStat.of`` every path at once, results in the order of ``paths``.

    One worker thread per path, at most MAX_STATS_IN_FLIGHT in flight (beyond
    that a worker takes every MAX_STATS_IN_FLIGHT-th path in turn), so N
    stats on remote storage cost about one round trip. A path that cannot be
    stat'ed is its ``OSError`` in the list; any other exception (a path with
    a NUL byte: ``ValueError``) is raised here once every stat has returned.
    Workers are parked and reused (:class:`_StatWorkers`).

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

    _workers.run([stride(k) for k in range(width)])
    done.acquire()
    if failures:
        raise failures[0]
    return [r if r is not None else OSError(f"{os.fspath(paths[i])}: not stat'ed") for i, r in enumerate(results)]


