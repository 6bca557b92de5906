"""The pool of parked threads that issues the restart check's stats at once.

A stat on remote storage blocks its thread for one round trip, so N stats
in about one round trip need N threads in flight. CPython spends ~100 us
creating each (measured on a 2-core VM, where 1,000 took 60-130 ms), so
the pool keeps them parked between checks and can be started before the
first check (:func:`prestart_stat_workers`, from vLLM's plugin
registration). :func:`preload.identity.filestat.stat_all` is the caller.
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable, Mapping

# Stats in flight at once; each waits one round trip on remote storage.
MAX_STATS_IN_FLIGHT = 1024
# A parked stat worker exits after this long without work.
STAT_WORKER_IDLE_S = 30.0
# Engine environment: stat workers to start at plugin registration (0: none).
STAT_WORKERS_ENV = "PRELOAD_GATE_STAT_WORKERS"


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
        all) and return the number parked once they are (or after ``wait_s``).

        Workers started here are pinned to one CPU (:func:`_one_cpu`): they
        run Python one at a time anyway (the GIL), and on one CPU each
        hand-off is a local wake-up, not a cross-CPU one. 1,000 parked stats
        at 50 ms went from 157-160 ms to 99-105 ms on this 2-core VM. Threads
        a check creates for itself are not pinned: the affinity call inside
        the clock cost more than it saved (390-630 ms against 284-343 ms).
        """
        with self._lock:
            n = max(0, min(n, MAX_STATS_IN_FLIGHT - len(self._parked)))
            target = len(self._parked) + n
        cpu = _one_cpu()
        for _ in range(n):
            _StatWorker(self).spawn(None, cpu)
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

    __slots__ = ("_pool", "_wake", "_job", "_cpu")

    def __init__(self, pool: _StatWorkers) -> None:
        self._pool = pool
        self._wake = threading.Lock()
        self._wake.acquire()
        self._job: Callable[[], None] | None = None
        self._cpu: set[int] | None = None

    def spawn(self, job: Callable[[], None] | None, cpu: set[int] | None = None) -> None:
        """Start the thread, running ``job`` first (None: park at once);
        ``cpu``: the CPU set the thread pins itself to before anything else."""
        self._job = job
        self._cpu = cpu
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
            if self._cpu is not None:
                try:
                    os.sched_setaffinity(0, self._cpu)  # 0: this thread only (sched_setaffinity(2))
                except OSError:
                    pass  # a CPU taken away meanwhile: unpinned is slower, never wrong
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


def _one_cpu() -> set[int] | None:
    """The CPU this thread last ran on, as a set for ``os.sched_setaffinity``
    (field 39 of /proc/thread-self/stat, proc(5)); None where unknown or
    when the process may run on one CPU only anyway. Each engine rank pins
    its workers to the CPU it runs on, so the ranks of one host do not
    share one."""
    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/thread-self/stat", "rb") as f:
            cpu = int(f.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return {cpu} if len(allowed) > 1 and cpu in allowed else None


_workers = _StatWorkers()


# Set by prestart_stat_workers: a forked child (vLLM's fork-started workers
# never re-run plugin registration) starts its own pool of this size.
_prestarted = 0


def _forget_workers_after_fork() -> None:
    # A forked child has none of its parent's threads; parked entries would hang.
    global _workers
    _workers = _StatWorkers()
    if _prestarted:
        prestart_stat_workers(_prestarted)


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


def stat_workers_wanted(environ: Mapping[str, str] = os.environ) -> int:
    """The pool size ``STAT_WORKERS_ENV`` asks for: 0 when unset or empty.

    Raises ValueError naming the variable for anything but an integer in
    0..MAX_STATS_IN_FLIGHT.

    >>> stat_workers_wanted({STAT_WORKERS_ENV: "1000"})
    1000
    """
    raw = environ.get(STAT_WORKERS_ENV, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_STATS_IN_FLIGHT:
        raise ValueError(f"{STAT_WORKERS_ENV}={raw!r} is not a worker count; set it to the checkpoint's shard "
                         f"count (0..{MAX_STATS_IN_FLIGHT}) or unset it")
    return n


def prestart_stat_workers(n: int, in_forks: bool = True) -> threading.Thread | None:
    """Start ``n`` stat workers from a background thread and return that
    thread (None for ``n <= 0``); with ``in_forks``, every child this
    process forks from now on starts its own.

    For vLLM's plugin registration (:func:`preload.loader.register`): it
    runs seconds before the first check, while vLLM initialises the device
    and the distributed group (waits that release the GIL), so the
    ~100 us per thread that CPython spends creating one is paid there
    instead of inside the restart check: at 1,000 shards, 50 ms per stat,
    the check took 4.6-9 round trips creating its threads and 2-2.6 with
    them parked (2-core VM; ``preload-gate bench --only restart_identity``).
    """
    global _prestarted
    if n <= 0:
        return None
    if in_forks:
        _prestarted = n
    thread = threading.Thread(target=start_stat_workers, args=(n,), name="preload-gate-stat-pool", daemon=True)
    thread.start()
    return thread


def stop_stat_workers() -> int:
    """Make the parked stat workers exit now (a process done checking, or a
    benchmark measuring a cold start); returns how many are still busy.
    A later :func:`stat_all` starts new ones."""
    return _workers.stop()


def run(jobs: list[Callable[[], None]]) -> None:
    """Start each job on its own worker of this process's pool and return
    (:meth:`_StatWorkers.run`); the jobs report their own completion."""
    _workers.run(jobs)
