"""A serving rank watches its fd store (issue 39).

The keeper holding a rank's arena can go while the rank serves: killed
(``kill -9``), or gone with its socket root (``rm -rf``, a temp cleaner:
the keeper exits once its socket is removed). Either way the arena is no
longer stored, and a crash of the daemon would mean a read from disk. So
once a second (:data:`INTERVAL_S`) the rank asks its store handle whether it
is still alive (:meth:`~preload.daemon.fdstore_base.FdStore.alive`); when it
is not, it says so in one warning line naming what is at risk (digest,
rank, bytes, checkpoint), opens a new store (which starts a new keeper and
re-creates the socket root 0700 where it was removed) and re-deposits the
arena (origin and generation kept). Where that fails it says so in one line,
with what is at risk, and tries again each interval, said once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from preload.daemon.fdstore import FdStore, FdStoreError, open_store

log = logging.getLogger("preload.daemon")

INTERVAL_S = 1.0


class StoreWatch:
    """Keeps ``store`` (the current handle, replaced after a loss) holding
    this rank's arena. ``redeposit(store) -> bool`` puts the arena in a new
    store; ``at_risk`` names what a crash would lose (for the lines)."""

    def __init__(self, store: FdStore, root: str, rank: int, at_risk: str,
                 redeposit: Callable[[FdStore], bool], interval_s: float = INTERVAL_S) -> None:
        self.store: FdStore | None = store
        self.root, self.rank, self.at_risk = root, rank, at_risk
        self.redeposit = redeposit
        self.interval_s = interval_s
        self.replaced = 0  # new stores that took the arena again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._said_failed = False
        self._thread = threading.Thread(target=self._run, name=f"store-watch-rank{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> FdStore | None:
        """Stop watching; the current handle (None: lost and not replaced)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._lock:
            return self.store

    def current(self) -> FdStore | None:
        with self._lock:
            return self.store

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> None:
        """One look: a lost store is said and replaced (or the failure said once)."""
        with self._lock:
            lost = self.store is not None and not self.store.alive()
            if lost:
                assert self.store is not None
                pid = getattr(self.store, "keeper_pid", 0)
                self.store.close()
                self.store = None
                log.warning("rank %d: the fd store under %s is gone (keeper pid %s: killed, or its socket root "
                            "removed); at risk: %s, stored nowhere now, a crash of this daemon means a reload; "
                            "starting a new keeper", self.rank, self.root, pid or "?", self.at_risk)
            if self.store is not None:
                return
            try:
                store = open_store(self.root, start=True)
            except FdStoreError as exc:
                self._failed(str(exc))
                return
            if store is None or not self.redeposit(store):
                if store is not None:
                    store.close()
                self._failed("the new store did not take the arena")
                return
            self.store, self._said_failed = store, False
            self.replaced += 1
            log.warning("rank %d: a new fd store (%s, keeper pid %s) under %s holds the arena again "
                        "(re-deposited): %s", self.rank, store.name, getattr(store, "keeper_pid", "?"),
                        self.root, self.at_risk)

    def _failed(self, why: str) -> None:
        if not self._said_failed:
            log.error("rank %d: the fd store under %s is lost and could not be replaced (%s); at risk: %s: a "
                      "crash of this daemon means a reload; trying again every %g s", self.rank, self.root,
                      why, self.at_risk, self.interval_s)
            self._said_failed = True
