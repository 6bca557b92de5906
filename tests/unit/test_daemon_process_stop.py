"""``DaemonProcess.stop`` returns as soon as the daemon's group is gone.

The bug it pins: ``os.killpg(pid, 0)`` succeeds while the group leader is an
unreaped zombie, so a stop that never reaped waited out its whole SIGTERM
deadline (15 s) after a daemon that exited at once, then sent SIGKILL to
nobody. Every demo paid it twice per target.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.daemon_process import DaemonProcess

pytestmark = pytest.mark.unit

# The SIGTERM deadline is 15 s; a stop that reaps returns in well under a
# second. The bound sits far from both so a loaded machine cannot flip it.
GENEROUS_S = 7.5


def _started(tmp_path: Path, script: str) -> DaemonProcess:
    dp = DaemonProcess(checkpoint="unused", socket_root=str(tmp_path), log_path=tmp_path / "log")
    dp.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                               stdout=subprocess.PIPE)
    assert dp.proc.stdout is not None
    assert dp.proc.stdout.readline() == b"up\n"  # the handler is installed before we signal
    return dp


def test_stop_returns_once_the_daemon_exits_on_sigterm(tmp_path: Path) -> None:
    dp = _started(tmp_path, "import signal,sys,time\n"
                            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                            "print('up', flush=True)\ntime.sleep(60)\n")
    proc = dp.proc
    t0 = time.monotonic()
    dp.stop()
    assert time.monotonic() - t0 < GENEROUS_S
    assert proc is not None and proc.returncode == 0  # it exited on SIGTERM, never needed SIGKILL


def test_control_a_daemon_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    # The other side of the same loop: ignoring SIGTERM costs the deadline,
    # then SIGKILL ends it (so the fast path above is not a stop that skips waiting).
    dp = _started(tmp_path, "import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                            "print('up', flush=True)\ntime.sleep(60)\n")
    proc = dp.proc
    t0 = time.monotonic()
    dp.stop()
    assert time.monotonic() - t0 >= 14.0
    assert proc is not None and proc.returncode == -9
