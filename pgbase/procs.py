"""Stop a child's whole process group: SIGTERM, wait, SIGKILL, reap the leader.

Every child that runs an engine or a daemon is started as the leader of its
own session (``start_new_session=True``), because what it leaves behind
(vLLM's engine-core processes, a daemon's rank processes) outlives it on
its own. :func:`stop_group` is the one way this project ends such a child.

Why not ``psutil``'s ``children()``/``wait_procs``: the group, not the tree,
is what must go. A rank or an engine core whose parent already exited is
re-parented away from the leader, so ``children(recursive=True)`` no longer
lists it, while ``os.killpg`` still reaches it; and ``psutil.wait_procs`` on
the leader reaps it behind ``Popen``'s back, which then reports exit code 0
for a child that was killed. So the group is signalled with ``os.killpg``
and the leader is reaped with ``Popen.poll``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

#: How often :func:`stop_group` looks whether the group is gone, in seconds.
POLL_S = 0.1


def group_alive(proc: subprocess.Popen[Any]) -> bool:
    """Whether any process of the group ``proc`` leads still exists.

    Reaps the leader first (``Popen.poll``): an exited but unreaped leader is
    a zombie, and a zombie keeps its group alive for ``killpg(pid, 0)``, so
    a loop that did not reap waited out its whole deadline after a child that
    had exited at once (tests/unit/test_daemon_process_stop.py pins it)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[Any], *, term_s: float, kill_s: float,
               reap_s: float | None = 5.0) -> int | None:
    """SIGTERM the process group ``proc`` leads and wait up to ``term_s``
    seconds for all of it to go; SIGKILL what is left and wait up to
    ``kill_s`` seconds more; then reap the leader (at most ``reap_s``
    seconds; None: however long it takes). Returns as soon as the group is gone.

    ``proc`` must have been started as a group leader
    (``start_new_session=True``); a group that is already gone is no error.
    Returns the leader's exit status (negative: the signal that ended it),
    or None when it still runs after all three waits (a process stuck in
    the kernel); raises nothing for a process that is gone.

    Example::

        proc = subprocess.Popen(cmd, start_new_session=True)
        ...
        stop_group(proc, term_s=5.0, kill_s=5.0)
    """
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while group_alive(proc) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if not group_alive(proc):
            break
    try:
        return proc.wait(timeout=reap_s)
    except subprocess.TimeoutExpired:
        return None


def stop_pid(pid: int, *, term_s: float, kill_s: float) -> bool:
    """SIGTERM one process that is not our child (a daemon another command
    started and left running, known by the pid it wrote), wait up to
    ``term_s`` seconds, then SIGKILL and wait up to ``kill_s`` more.

    Returns whether it is gone. A pid that no longer exists is gone, and so
    is a zombie: it has exited and holds nothing but its pid until its own
    parent reaps it, which is no business of ours (psutil's ``wait`` on a
    non-child polls for the pid, so a zombie would be "running" forever).
    psutil remembers the process's start time, so a pid reused meanwhile by
    another process is not signalled.
    """
    import psutil

    try:
        p = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    for send, wait_s in ((p.terminate, term_s), (p.kill, kill_s)):
        if _exited(p):
            return True
        try:
            send()
        except psutil.NoSuchProcess:
            return True
        if _wait_exited(p, wait_s):
            return True
    return False


def _exited(p: Any) -> bool:
    """Whether the psutil process ``p`` is gone or a zombie (exited, unreaped)."""
    import psutil

    try:
        return bool(p.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _wait_exited(p: Any, wait_s: float) -> bool:
    """Wait up to ``wait_s`` seconds for ``p`` to exit (reaping it when it is our child)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        try:
            p.wait(max(0.0, min(POLL_S, deadline - time.monotonic())))
            return True
        except psutil.TimeoutExpired:
            pass
        if _exited(p):
            return True
        if time.monotonic() >= deadline:
            return False


def stop_pgid(pgid: int, *, term_s: float, kill_s: float) -> bool:
    """:func:`stop_group` for a group whose leader is not our child: one a
    process before us started as a session leader and recorded by pid (a
    replica started by an earlier run of a rollout that was killed).

    SIGTERM the group, wait up to ``term_s`` seconds for every member to go,
    SIGKILL what is left and wait up to ``kill_s`` more; returns whether the
    group is gone. A leader that is our child must go through
    :func:`stop_group` instead (only a ``Popen`` reaps it, and an unreaped
    leader keeps the group alive). Checking that ``pgid`` is still the
    process meant (its start time) is the caller's part.
    """
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(POLL_S)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
