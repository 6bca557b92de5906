"""A simulated remote filesystem: count (and delay) every file access under a root.

Restart cost on network storage is dominated by round trips, not bytes: an
open, a read, a stat each wait for the server. This shim patches the file
entry points Python code goes through (``open``, ``io.open``, ``os.open``,
``os.read``/``pread``, ``os.stat``/``lstat``/``fstat``, ``os.scandir``,
``os.listdir``) for the duration of a ``with`` block, counts the calls that
touch a path under one of its roots, and sleeps a fixed latency for each.
The schemes it measures are unchanged code (vLLM's own ``hash_checkpoint``
included); the counts are observed, not declared.

Reads are counted per call (one ``read``/``readinto``/``pread`` is one
round trip), which is how a client without read-ahead pays.

Concurrent calls overlap, as they do on a remote server: the shim's lock
covers its counters, never the latency, which is slept outside it (a unit
test pins this, with a lock-held control). What it cannot model exactly is
the GIL: the real call runs, then the sleep, so a charged call releases
the GIL twice where a kernel client blocking in the call releases it once.
At 1,000 concurrent stats that added about 15-30 ms of wall on a loaded
2-core machine (measured against the same stats with their results taken
before the clock); the error is against the code under test, never for it.

>>> with RemoteFS(["/models/m"], latency_s=0.05) as fs:  # doctest: +SKIP
...     header_only("/models/m")
>>> fs.counts.opens  # doctest: +SKIP
67
"""

from __future__ import annotations

import builtins
import io
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from preload.identity.filestat import STAT_BACKEND_ENV


@dataclass
class IOCounts:
    """Accesses under the shim's roots."""

    opens: int = 0
    reads: int = 0
    stats: int = 0
    listdirs: int = 0
    bytes_read: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @property
    def touched(self) -> int:
        return self.opens + self.reads + self.stats + self.listdirs


class _CountingFile:
    """A file object whose read calls are counted and delayed; all else delegates."""

    _READS = ("read", "readinto", "read1", "readinto1", "readline", "readlines")

    def __init__(self, fs: RemoteFS, raw: Any, fd: int | None = None) -> None:
        self._fs = fs
        self._raw = raw
        self._fd = fd

    def close(self) -> None:
        self._fs._forget(self._fd)
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._raw, name)
        if name in self._READS:
            def counted(*a: Any, **kw: Any) -> Any:
                result = attr(*a, **kw)
                n = result if isinstance(result, int) else len(result or b"")
                self._fs._charge("reads", n)
                return result

            return counted
        return attr

    def __enter__(self) -> _CountingFile:
        self._raw.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self._fs._forget(self._fd)
        return self._raw.__exit__(*exc)

    def __iter__(self) -> Any:
        for line in self._raw:
            self._fs._charge("reads", len(line))
            yield line


class RemoteFS:
    """Patch file access for a ``with`` block; ``counts`` holds what was charged.

    ``latency_s`` is charged per open and per read; ``stat_latency_s`` per
    stat and per directory listing (None: the same as ``latency_s``; 0 to
    model a client with an attribute cache).
    """

    def __init__(
        self,
        roots: Iterable[str | os.PathLike[str]],
        latency_s: float = 0.0,
        stat_latency_s: float | None = None,
    ) -> None:
        self.roots = tuple(os.path.abspath(os.fspath(r)) for r in roots)
        self.latency_s = latency_s
        self.stat_latency_s = latency_s if stat_latency_s is None else stat_latency_s
        self.counts = IOCounts()
        self._lock = threading.Lock()
        self._fds: set[int] = set()
        self._saved: dict[tuple[Any, str], Any] = {}
        self._backend: str | None = None

    # -- accounting ---------------------------------------------------------

    def _under(self, path: Any) -> bool:
        if isinstance(path, int):
            return path in self._fds
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        p = p if p.startswith("/") else os.path.join(os.getcwd(), p)
        p = os.path.normpath(p)
        return any(p == r or p.startswith(r + os.sep) for r in self.roots)

    def _charge(self, kind: str, nbytes: int = 0) -> None:
        with self._lock:
            setattr(self.counts, kind, getattr(self.counts, kind) + 1)
            if kind == "reads":
                self.counts.bytes_read += nbytes
        delay = self.stat_latency_s if kind in ("stats", "listdirs") else self.latency_s
        if delay > 0:
            time.sleep(delay)

    # -- patched entry points --------------------------------------------------

    def _open(self, file: Any, *a: Any, **kw: Any) -> Any:
        raw = self._saved[(builtins, "open")](file, *a, **kw)
        if self._under(file):
            self._charge("opens")
            try:
                fd = raw.fileno()
            except (AttributeError, OSError, ValueError):
                fd = None
            if fd is not None:
                with self._lock:
                    self._fds.add(fd)
            return _CountingFile(self, raw, fd)
        return raw

    def _os_open(self, path: Any, *a: Any, **kw: Any) -> int:
        fd = self._saved[(os, "open")](path, *a, **kw)
        if self._under(path):
            self._charge("opens")
            with self._lock:
                self._fds.add(fd)
        return fd

    def _forget(self, fd: int | None) -> None:
        if fd is not None:
            with self._lock:
                self._fds.discard(fd)

    def _os_close(self, fd: int) -> None:
        self._forget(fd)
        self._saved[(os, "close")](fd)

    def _os_read(self, fd: int, n: int) -> bytes:
        data = self._saved[(os, "read")](fd, n)
        if fd in self._fds:
            self._charge("reads", len(data))
        return data

    def _os_pread(self, fd: int, n: int, offset: int) -> bytes:
        data = self._saved[(os, "pread")](fd, n, offset)
        if fd in self._fds:
            self._charge("reads", len(data))
        return data

    def _stat_like(self, name: str) -> Any:
        real = self._saved[(os, name)]

        def wrapped(path: Any, *a: Any, **kw: Any) -> Any:
            result = real(path, *a, **kw)
            if self._under(path):
                self._charge("stats")
            return result

        return wrapped

    def _list_like(self, name: str) -> Any:
        real = self._saved[(os, name)]

        def wrapped(path: Any = ".", *a: Any, **kw: Any) -> Any:
            result = real(path, *a, **kw)
            if self._under(path):
                self._charge("listdirs")
            return result

        return wrapped

    def __enter__(self) -> RemoteFS:
        targets = [(builtins, "open"), (io, "open"), (os, "open"), (os, "close"), (os, "read"),
                   (os, "pread"), (os, "stat"), (os, "lstat"), (os, "fstat"), (os, "scandir"),
                   (os, "listdir")]
        for mod, name in targets:
            self._saved[(mod, name)] = getattr(mod, name)
        self._saved[(builtins, "open")] = builtins.open
        patches = {
            (builtins, "open"): self._open,
            (io, "open"): self._open,
            (os, "open"): self._os_open,
            (os, "close"): self._os_close,
            (os, "read"): self._os_read,
            (os, "pread"): self._os_pread,
            (os, "stat"): self._stat_like("stat"),
            (os, "lstat"): self._stat_like("lstat"),
            (os, "fstat"): self._stat_like("fstat"),
            (os, "scandir"): self._list_like("scandir"),
            (os, "listdir"): self._list_like("listdir"),
        }
        for (mod, name), fn in patches.items():
            setattr(mod, name, fn)
        # The shim sees only stats issued from Python: the restart check's
        # io_uring stats would pass it uncounted and undelayed, so inside the
        # block they go through the thread pool (preload.identity.filestat).
        self._backend = os.environ.get(STAT_BACKEND_ENV)
        os.environ[STAT_BACKEND_ENV] = "pool"
        return self

    def __exit__(self, *exc: Any) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        if self._backend is None:
            os.environ.pop(STAT_BACKEND_ENV, None)
        else:
            os.environ[STAT_BACKEND_ENV] = self._backend
