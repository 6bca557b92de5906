"""A live daemon keeps its home: socket directory, socket and lock file.

Temp-file cleaners remove files from under live daemons: systemd-tmpfiles
ages out files in /tmp, logind removes /run/user/<uid> when a user's last
session ends, an operator runs ``rm -rf /tmp/preload-gate-*`` (field case
r10). A daemon whose socket is gone is resident and unreachable; one whose
lock file is gone invites a second resident copy. So each rank watches its
three paths by inode, once a second:

- directory removed: re-created (0700, trust-checked), then the rest below;
- lock file removed or replaced by a free file: re-created and locked
  (``RankLock.reclaim``); held by another live process for longer than a
  grace period: the home is lost (below);
- socket removed: bound again at the same path; replaced by a socket that
  answers (another daemon serves here now): the home is lost. A stale file
  in its place is ours to replace, as at start;
- every ``touch_s`` the three are touched, so age-based cleaners leave them.

"Lost" means this daemon cannot be reached the way engines look for it and
some other process now owns the path: it logs one error line naming the
path and stops (``on_lost``), rather than stay resident unreachable. It
never removes what it did not create: stopping checks inodes (see
``RankServer.stop`` and ``RankLock.release``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from preload.daemon.lock import RankBusyError, RankLock, socket_answers
from preload.sockets import ensure_private_dir

log = logging.getLogger("preload.daemon")

# Set to 1 only as a NEGATIVE CONTROL in tests: the daemon then does not watch its home.
UNSAFE_NO_WATCH_ENV = "PRELOAD_GATE_UNSAFE_NO_HOME_WATCH"
INTERVAL_S = 1.0
BUSY_GRACE_S = 10.0
TOUCH_S = 3600.0


class _Home(Protocol):
    socket_dir: Path
    path: Path

    @property
    def lock(self) -> RankLock: ...

    def socket_inode(self) -> tuple[int, int] | None: ...

    def rebind(self) -> None: ...


def inode_of(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(dev, ino) of ``path`` itself (not followed); None when absent.

    An identity only while the file is held open (the lock's fd, the bound
    listener of a socket): a freed inode number can be reused.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def unlink_if(path: str | os.PathLike[str], inode: tuple[int, int] | None) -> bool:
    """Remove ``path`` only when it is still the file with ``inode`` (ours)."""
    if inode is None or inode_of(path) != inode:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_if_empty(directory: str | os.PathLike[str]) -> bool:
    """Remove a stopped daemon's socket directory when nothing is left in it.

    ``rmdir`` removes only an empty directory, so another rank's (or a
    successor's) socket and lock are never touched; a successor that made the
    directory in between makes it again (``preload.daemon.rank``).
    """
    try:
        os.rmdir(directory)
    except OSError:  # not empty, already gone, or not ours to remove
        return False
    return True


class HomeWatch:
    """Watches one rank's home and repairs it; see the module docstring."""

    def __init__(self, home: _Home, on_lost: Callable[[str], None], interval_s: float = INTERVAL_S,
                 busy_grace_s: float = BUSY_GRACE_S, touch_s: float = TOUCH_S) -> None:
        self.home = home
        self.on_lost = on_lost
        self.interval_s = interval_s
        self.busy_grace_s = busy_grace_s
        self.touch_s = touch_s
        self.repairs: list[str] = []
        self._dir_inode = inode_of(home.socket_dir)
        self._busy_since: float | None = None
        self._last_touch = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    @classmethod
    def enabled(cls) -> bool:
        return os.environ.get(UNSAFE_NO_WATCH_ENV, "") != "1"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="home-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # a watcher that dies silently would be worse than none
                self._lose(f"cannot keep its socket home {self.home.socket_dir}: {type(exc).__name__}: {exc}")
            if self.lost:
                return

    def _lose(self, reason: str) -> None:
        self.lost = reason
        log.error("rank home lost: %s; stopping this daemon so that no unreachable copy stays resident", reason)
        self.on_lost(reason)

    def check(self) -> None:
        """One pass: directory, lock, socket, touch. Public for tests."""
        h = self.home
        d = inode_of(h.socket_dir)
        if d is None or d != self._dir_inode:
            if d is not None and not stat.S_ISDIR(os.lstat(h.socket_dir).st_mode):
                return self._lose(f"{h.socket_dir} was replaced by something that is not a directory")
            ensure_private_dir(h.socket_dir)  # raises, by name, on a symlink or another owner
            self._dir_inode = inode_of(h.socket_dir)
            self._repair(f"socket directory {h.socket_dir} was {'removed' if d is None else 'replaced'}; re-created")
        try:
            if h.lock.reclaim():
                self._repair(f"lock file {h.lock.path} was removed or replaced; re-created and locked")
            self._busy_since = None
        except RankBusyError as exc:
            now = time.monotonic()
            self._busy_since = self._busy_since or now
            if now - self._busy_since > self.busy_grace_s:
                return self._lose(str(exc))
        sock = inode_of(h.path)
        if sock != h.socket_inode():
            if sock is not None and socket_answers(h.path):
                return self._lose(f"another process answers on {h.path} now")
            if sock is not None:
                os.unlink(h.path)  # a stale file in our place (the directory is ours, checked above)
            h.rebind()
            self._repair(f"socket {h.path} was {'removed' if sock is None else 'replaced'}; bound again")
        if time.monotonic() - self._last_touch > self.touch_s:
            for p in (h.socket_dir, h.lock.path, h.path):
                try:
                    os.utime(p, follow_symlinks=False)
                except OSError:
                    pass
            self._last_touch = time.monotonic()
        return None

    def _repair(self, what: str) -> None:
        self.repairs.append(what)
        log.warning("rank home repaired: %s", what)
