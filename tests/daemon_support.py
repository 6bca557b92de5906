"""Start and stop ``preload-gate preload`` subprocesses for the daemon tests."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_dir(prefix: str = "pg-d-") -> Path:
    """AF_UNIX paths are capped at 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preload_gate.cli", "preload", str(self.checkpoint),
             *(["--socket-root", str(self.root)] if self.root is not None else []), *self.args],
            stdout=subprocess.PIPE, stderr=self._err, env={**env_for(self.cache), **self.env}, cwd=self.cwd,
        )
        end = time.monotonic() + timeout
        assert self.proc.stdout is not None
        buf = b""
        while time.monotonic() < end:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                if b"\n" in buf:
                    self.ready = json.loads(buf.split(b"\n", 1)[0])
                    return self
            elif self.proc.poll() is not None:
                break
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


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
