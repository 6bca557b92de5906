"""The preload daemon as a child of the gate: start, wait for ready, stop.

The gate drives the daemon through its CLI (``preload-gate preload``), as an
operator would, so what is judged is the shipped entry point. The daemon
runs in its own process group; stopping it signals the whole group, and a
daemon that never says ready within the deadline is killed and its log tail
becomes the error. It is started with ``--exit-with-parent``: if the gate
dies without stopping it (SIGKILL, a crash), it stops by itself within a
second and removes its socket directory.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgbase.errors import PreloadGateError
from pgbase.procs import stop_group
from preload.daemon.ready import READY, NotReadyError, start_preload, wait_ready

READY_TIMEOUT_S = 240.0


class DaemonStartError(PreloadGateError):
    """The preload daemon exited or stayed silent instead of reporting ready."""


@dataclass
class DaemonProcess:
    """A running ``preload-gate preload`` and the ready line it printed."""

    checkpoint: str
    socket_root: str
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the daemon's environment only
    proc: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    start_seconds: float = 0.0
    # Off only for a test's control: a daemon that outlives a killed starter.
    exit_with_parent: bool = True

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> DaemonProcess:
        args = [self.checkpoint, "--socket-root", self.socket_root, *self.args]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # exit_with_parent: a gate killed by any signal, SIGKILL included,
            # must not leave a resident daemon and its socket directory behind.
            self.proc = start_preload(args, env=env, stderr=log, new_session=True,
                                      exit_with_parent=self.exit_with_parent)
        try:
            try:
                self.ready = wait_ready(self.proc, READY, timeout_s)
            except NotReadyError as exc:
                if exc.timed_out:
                    raise DaemonStartError(f"daemon on {self.checkpoint} not ready after {timeout_s:.0f} s"
                                           f"{self._tail()}") from None
                raise DaemonStartError(f"daemon exited with code {exc.returncode} before ready{self._tail()}") \
                    from None
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    @property
    def digest(self) -> str:
        return str(self.ready.get("digest", ""))

    def _tail(self, chars: int = 2000) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "; log tail:\n" + text[-chars:] if text else ""

    def stop(self) -> None:
        """SIGTERM the group (clean shutdown removes sockets; 15 s), SIGKILL
        stragglers (5 s), reap the launcher (5 s)."""
        if self.proc is None:
            return
        stop_group(self.proc, term_s=15.0, kill_s=5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
