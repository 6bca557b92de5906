"""Start a daemon process and wait for its ready line: the one way to do both.

Two processes announce themselves with one JSON line on stdout: a rank
(``python -m preload.daemon.rank``, its config as JSON on stdin) prints
``{"event": "rank_ready", ...}``, or ``{"event": "rank_error", "error":
...}`` before it exits 2 (:mod:`preload.daemon.rank`); the launcher
(``preload-gate preload``) prints ``{"event": "ready", ...}`` once every
rank has (:mod:`preload.daemon.launcher`). The launcher starts its ranks
here, and the gate, the benches and the tests start the launcher here.

A thread drains each process's stdout until EOF, for as long as the process
lives: a pipe nobody reads fills, and a process that then writes to it (a
rank's vLLM logs go to stdout) blocks. Lines that are not JSON go to the
caller's ``other`` (the launcher forwards them to its stderr).

Example::

    proc = start_preload([checkpoint, "--stage", "raw"], stderr=log)
    ready = wait_ready(proc, READY, timeout_s=240.0)  # NotReadyError if it dies first
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Generic, TypeVar

from pgbase.errors import PreloadGateError
from preload.daemon.parent import PARENT_PID_ENV

READY = "ready"  # the launcher's line
RANK_READY = "rank_ready"  # a rank's line
RANK_ERROR = "rank_error"  # a rank's refusal, printed before it exits 2

# The shipped verb, as an operator runs it; named as a command line, so
# preload imports nothing above it (preload_gate is the top layer).
PRELOAD_COMMAND = ("-m", "preload_gate", "preload")
RANK_COMMAND = ("-m", "preload.daemon.rank")
EXIT_WAIT_S = 10.0  # for the exit status of a process whose stdout ended

K = TypeVar("K")
Stderr = int | IO[Any] | None


class NotReadyError(PreloadGateError):
    """A daemon process exited, printed ``rank_error`` or stayed silent past
    its deadline before its ready line.

    ``key``: which process (the launcher's rank number; 0 for one process).
    ``returncode``: its exit status, None while it still runs. ``timed_out``:
    the deadline passed. ``error``: the text of its ``rank_error`` line, or "".
    """

    def __init__(self, message: str, *, key: Any, returncode: int | None, timed_out: bool = False,
                 error: str = "") -> None:
        super().__init__(message)
        self.key, self.returncode, self.timed_out, self.error = key, returncode, timed_out, error


def start_preload(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Any = None,
                  stderr: Stderr = None, new_session: bool = False,
                  exit_with_parent: bool = False) -> subprocess.Popen[bytes]:
    """``preload-gate preload ARGS`` with stdout piped for its ready line.
    ``new_session``: lead a process group of its own (stop it with
    :func:`pgbase.procs.stop_group`). ``exit_with_parent``: the daemon stops
    by itself (and removes its sockets) when this process dies without
    stopping it, SIGKILL included (``--exit-with-parent``, watching our pid)."""
    if exit_with_parent:
        args = ["--exit-with-parent", *args]
        # Whom it watches, named by us: a starter killed before the child
        # looked at getppid() would otherwise go unnoticed.
        env = {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}
    return subprocess.Popen([sys.executable, *PRELOAD_COMMAND, *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd,
                            start_new_session=new_session)


def start_rank(config: Mapping[str, Any], *, env: Mapping[str, str] | None = None, cwd: Any = None,
               stderr: Stderr = None, pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """One rank process, ``config`` (a :class:`preload.daemon.stage.RankConfig`
    as JSON) written to its stdin, its stdout piped for its ready line;
    ``pass_fds`` stay open in it under the same numbers (the fds systemd's
    store passed the launcher: :mod:`preload.daemon.fdstore_systemd`)."""
    proc = subprocess.Popen([sys.executable, *RANK_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, env=env, cwd=cwd, pass_fds=tuple(pass_fds))
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(dict(config)) + "\n").encode())
    proc.stdin.close()
    return proc


def stop_daemon(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM one daemon process (a launcher then stops its ranks, a rank
    removes its socket), wait up to ``timeout_s`` seconds, SIGKILL it if it
    still runs; returns its exit status. Only that process is signalled: for
    a whole process group use :func:`pgbase.procs.stop_group`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


class ReadyLines(Generic[K]):
    """The JSON lines of several daemon processes' stdout, read on one thread
    each until EOF; :meth:`wait` for each one's ready line."""

    def __init__(self, procs: Mapping[K, subprocess.Popen[bytes]],
                 other: Callable[[str], None] | None = None) -> None:
        self.procs = dict(procs)
        self._other = other
        self._events: queue.Queue[tuple[K, dict[str, Any] | None]] = queue.Queue()
        for key, proc in self.procs.items():
            threading.Thread(target=self._pump, args=(key, proc), name=f"ready-lines-{key}", daemon=True).start()

    def _pump(self, key: K, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if isinstance(obj, dict):
                    self._events.put((key, obj))
                elif self._other is not None:
                    self._other(line)
        except (OSError, ValueError):  # the owner closed the pipe: the same end as EOF
            pass
        self._events.put((key, None))

    def wait(self, event: str, timeout_s: float | None, *, on_idle: Callable[[], None] = lambda: None,
             poll_s: float = 1.0) -> dict[K, dict[str, Any]]:
        """Each process's first JSON line whose ``event`` is ``event``, by key.

        Raises :class:`NotReadyError` for the first process that ends its
        stdout, exits, or prints ``rank_error`` first, or when ``timeout_s``
        seconds pass (None: no deadline); a process that exited is given one
        more ``poll_s`` for lines still in its pipe. ``on_idle`` runs every
        ``poll_s`` seconds without a line and may raise to stop the wait (the
        launcher's signals). Stopping the processes is the caller's part.
        """
        ready: dict[K, dict[str, Any]] = {}
        exited: set[K] = set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(ready) < len(self.procs):
            wait_s = poll_s if deadline is None else min(poll_s, max(0.05, deadline - time.monotonic()))
            try:
                key, obj = self._events.get(timeout=wait_s)
            except queue.Empty:
                on_idle()
                if deadline is not None and time.monotonic() >= deadline:
                    key = next(k for k in self.procs if k not in ready)
                    raise NotReadyError(f"not ready after {timeout_s:g} s", key=key,
                                        returncode=self.procs[key].poll(), timed_out=True) from None
                for key, proc in self.procs.items():
                    if key not in ready and proc.poll() is not None:
                        if key in exited:
                            raise NotReadyError(f"exited with code {proc.returncode} before ready", key=key,
                                                returncode=proc.returncode) from None
                        exited.add(key)
                continue
            if key in ready:
                continue
            if obj is None:
                try:
                    rc: int | None = self.procs[key].wait(timeout=EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    rc = None
                raise NotReadyError(f"exited with code {rc} before ready", key=key, returncode=rc)
            if obj.get("event") == RANK_ERROR:
                raise NotReadyError(str(obj.get("error")), key=key, returncode=self.procs[key].poll(),
                                    error=str(obj.get("error")))
            if obj.get("event") == event:
                ready[key] = obj
        return ready


def wait_ready(proc: subprocess.Popen[bytes], event: str, timeout_s: float | None,
               other: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One process's ready line (``event``: :data:`READY` or :data:`RANK_READY`);
    raises :class:`NotReadyError` as :meth:`ReadyLines.wait` does."""
    return ReadyLines({0: proc}, other).wait(event, timeout_s)[0]
