"""``pgbase.procs.stop_group`` (what ``DaemonProcess.stop``, the engine
runner, the golden recorder and the prepare children use) returns as soon as
the group is gone, and kills what outlives its SIGTERM deadline.

The bug it pins: ``os.killpg(pid, 0)`` succeeds while the group leader is an
unreaped zombie, so a stop that never reaped waited out its whole SIGTERM
deadline (15 s) after a daemon that exited at once, then sent SIGKILL to
nobody. Every demo paid it twice per target.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.daemon_process import DaemonProcess
from pgbase.procs import group_alive, stop_group

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


def _leader(script: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"up\n"
    return proc


def test_control_an_unreaped_leader_keeps_its_group_alive_for_killpg() -> None:
    # The trap itself: without reaping, killpg(pid, 0) says the group lives.
    proc = _leader("print('up', flush=True)")
    ps = psutil.Process(proc.pid)
    end = time.monotonic() + 60
    while ps.status() != psutil.STATUS_ZOMBIE and time.monotonic() < end:
        time.sleep(0.05)
    assert ps.status() == psutil.STATUS_ZOMBIE
    os.killpg(proc.pid, 0)  # no ProcessLookupError: the zombie leader counts
    assert not group_alive(proc)  # reaping first, as stop_group does, sees it gone
    assert proc.returncode == 0


def test_stop_group_kills_a_member_that_outlives_its_leader() -> None:
    # The leader exits on SIGTERM; a member of its group ignores it. A stop
    # that waited for the leader only would leave the member running.
    script = ("import signal,subprocess,sys,time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import signal,time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)'],"
              " stdout=subprocess.PIPE)\n"
              "c.stdout.readline()\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
              "print(c.pid, flush=True)\ntime.sleep(600)\n")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout is not None
    member = psutil.Process(int(leader.stdout.readline()))
    assert os.getpgid(member.pid) == leader.pid
    assert stop_group(leader, term_s=1.0, kill_s=30.0) == 0  # the leader went on SIGTERM
    assert not member.is_running() or member.status() == psutil.STATUS_ZOMBIE


def _orphan(script: str) -> int:
    """A process that is NOT our child (its parent exited), as a daemon the
    pipeline left running is: its pid, once its handler is installed."""
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys\n"
         f"p = subprocess.Popen([sys.executable, '-c', {script!r}], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)\n"
         "assert p.stdout.readline() == b'up\\n'\nprint(p.pid)"],
        capture_output=True, text=True, timeout=60, check=True)
    return int(launcher.stdout)


def test_stop_pid_ends_a_process_that_is_not_our_child() -> None:
    from pgbase.procs import stop_pid

    pid = _orphan("import time\nprint('up', flush=True)\ntime.sleep(300)")
    assert psutil.pid_exists(pid) and psutil.Process(pid).ppid() != os.getpid()
    assert stop_pid(pid, term_s=30.0, kill_s=10.0)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_stop_pid_kills_what_ignores_sigterm_and_a_gone_pid_is_gone() -> None:
    from pgbase.procs import stop_pid

    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)"
    pid = _orphan(script)
    # Control: SIGTERM alone does not end it.
    os.kill(pid, 15)
    time.sleep(0.5)
    assert psutil.pid_exists(pid)
    assert stop_pid(pid, term_s=0.5, kill_s=10.0)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert stop_pid(pid, term_s=0.1, kill_s=0.1)  # already gone: nothing to do, no error


def test_stop_pid_takes_a_zombie_for_stopped() -> None:
    """A process that exited and that its own parent has not reaped (a
    launcher busy elsewhere) is a zombie: stopped, though its pid exists.
    It used to be "still running" after both deadlines (False), because
    psutil's wait on a non-child polls for the pid. Here the zombie is the
    child of a parent that sleeps instead of reaping it."""
    from pgbase.procs import stop_pid

    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
         "print(pid, flush=True)\ntime.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        zombie = psutil.Process(int(parent.stdout.readline()))
        for _ in range(600):  # until the child has exited (at once, in practice)
            if zombie.status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
        assert zombie.status() == psutil.STATUS_ZOMBIE and zombie.ppid() == parent.pid
        assert stop_pid(zombie.pid, term_s=0.5, kill_s=0.5)
        assert parent.poll() is None, "only the zombie was the target"
    finally:
        parent.kill()
        parent.wait()
