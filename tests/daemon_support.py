"""Start and stop ``preload-gate preload`` subprocesses for the daemon tests."""

from __future__ import annotations

import errno
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from preload.daemon.ready import READY, NotReadyError, start_preload, stop_daemon, wait_ready

REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    """PYTHONPATH for a child: the repo first, then the caller's own entries
    (the GPU run puts msgspec there: scripts/gpu_suite.sh)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def short_dir(prefix: str = "pg-d-") -> Path:
    """AF_UNIX paths are capped at 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def socket_dir_in_own_root(prefix: str, name: str) -> Iterator[Path]:
    """A socket dir ``name`` (mode 0700) under a short socket root of its own
    (``status`` scans the root), removed whole afterwards: a fixture's body."""
    root = short_dir(prefix)
    d = root / name
    d.mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(root)


def env_for(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PRELOAD_GATE_CACHE"] = str(cache)
    return env


@dataclass
class Daemon:
    checkpoint: Path
    root: Path | None
    cache: Path
    args: tuple[str, ...] = ("--stage", "raw")
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)
    output: str = ""
    # Extra environment (a session's variables); root None: the default socket root.
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO  # where the command runs: a relative --socket-root is relative to it

    def start(self, timeout: float = 120, expect_ready: bool = True) -> Daemon:
        # stderr to a file: a pipe nobody drains would block a chatty daemon.
        self._err = tempfile.TemporaryFile()
        self.proc = start_preload(
            [str(self.checkpoint), *(["--socket-root", str(self.root)] if self.root is not None else []), *self.args],
            stderr=self._err, env={**env_for(self.cache), **self.env}, cwd=self.cwd,
        )
        try:
            self.ready = wait_ready(self.proc, READY, timeout)
            return self
        except NotReadyError:
            pass
        if self.proc.poll() is None:
            self.stop()
        self.proc.wait(30)
        self.output = self._stderr()
        if expect_ready:
            raise AssertionError(f"daemon did not become ready (rc {self.proc.returncode}):\n{self.output[-3000:]}")
        return self

    @property
    def socket_dir(self) -> Path:
        return Path(self.ready["socket_dir"])

    @property
    def rank_pid(self) -> int:
        return int(self.ready["ranks"][0]["pid"])

    def stop(self) -> int:
        if self.proc is None:
            return 0
        stop_daemon(self.proc, 30)
        self.output = self._stderr()
        return self.proc.returncode

    def _stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def kill_hard(self) -> None:
        """SIGKILL the rank and the launcher: what a crash leaves behind."""
        os.kill(self.rank_pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        for _ in range(100):
            try:
                os.kill(self.rank_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def process_gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its reaper (an orphan's
    reaper may be slow, or absent as PID 1 in a container)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def starter_line(proc: subprocess.Popen, bound: float) -> str:
    """The next line a starter process prints on its stdout pipe (stripped),
    within ``bound`` seconds; fails the test naming which did not come."""
    assert proc.stdout is not None
    r, _, _ = select.select([proc.stdout], [], [], bound)
    assert r, "the starter printed nothing"
    line = proc.stdout.readline()
    assert line, f"the starter exited (rc {proc.wait()})"
    return line.strip()


def wait_for(cond, bound: float) -> bool:
    """Poll ``cond`` until true or ``bound`` seconds pass (a bound, not a timing claim)."""
    end = time.monotonic() + bound
    while not cond():
        if time.monotonic() > end:
            return bool(cond())
        time.sleep(0.1)
    return True


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def bind_private(path: Path) -> socket.socket:
    """An AF_UNIX socket bound at ``path``, mode 0600 (as a daemon binds its own)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    return s


def fill_backlog(path: Path, most: int = 2000) -> list[socket.socket]:
    """Non-blocking connects to ``path`` until one gets EAGAIN (its listen
    backlog is full); the connections, to close when done."""
    held: list[socket.socket] = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError as exc:
            s.close()
            assert exc.errno == errno.EAGAIN
            return held
        held.append(s)
        assert len(held) < most, "the backlog never filled"


class FullListener:
    """An AF_UNIX listener with backlog 0 that never accepts, its queue filled."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = bind_private(path)
        self.listener.listen(0)
        self.held = fill_backlog(path)

    def close(self) -> None:
        for s in self.held:
            s.close()
        self.listener.close()
