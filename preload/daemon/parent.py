"""Stop with the process that started us: the one orphan check of the daemon.

Two places need it. A rank must not outlive its launcher: after ``kill -9``
of ``preload-gate preload`` an orphaned rank would hold its lock and memory
forever and block the next daemon (test_faults_daemon.py). And a launcher
started by a supervisor that asks for it (``preload --exit-with-parent``;
the gate does) must not outlive that supervisor, or a killed gate leaves a
resident daemon and its socket directory behind (test_parent_exit.py).

Both poll ``getppid()``: when the parent dies the kernel reparents the child
(to init or a subreaper), so the parent pid changes. Not PR_SET_PDEATHSIG:
it fires when the parent *thread* that forked exits, and the gate starts
processes from worker threads; it is also lost across a set-uid exec. The
poll costs one syscall every half second.
"""

from __future__ import annotations

import os

INTERVAL_S = 0.5
# The starter's own pid, set by the starter for its child: a child that
# looked at getppid() itself would miss a starter killed before it looked.
PARENT_PID_ENV = "PRELOAD_GATE_PARENT_PID"


class ParentWatch:
    """Remembers the parent pid at construction; :meth:`gone` says whether it died.

    Construct it as early as possible in the child (before slow imports or
    loading), so a parent that dies during start-up is still seen.

    >>> watch = ParentWatch()
    >>> watch.gone()
    False
    """

    def __init__(self, parent: int | None = None) -> None:
        self.parent = os.getppid() if parent is None else parent

    @classmethod
    def from_env(cls) -> ParentWatch:
        """The parent named by ``$PRELOAD_GATE_PARENT_PID`` (then removed from
        the environment, so that our own children do not take it for theirs),
        else the parent now."""
        value = os.environ.pop(PARENT_PID_ENV, "")
        return cls(int(value)) if value.isdigit() else cls()

    def gone(self) -> bool:
        """True once this process has been reparented: its starter is dead."""
        return os.getppid() != self.parent
