"""Which filesystem a path lives on, from the kernel's mount table.

Low in the tree (pgbase) so that :mod:`pgbase.oscause` can name the
filesystem that refused an entry (procfs answers ENOENT to a mkdir in
/proc) and :mod:`preload.identity.filestat` can tell a filesystem whose stat
sees every edit from one whose stat does not, from the same reader.
"""

from __future__ import annotations

import errno
import os

# A full descriptor table: pgbase.oscause.FILE_LIMIT_ERRNOS, not imported
# because oscause imports this module.
_FILE_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})

# Kernel filesystems that hold no files of their own: their directories
# refuse new entries a user makes (a mkdir in /proc is ENOENT, in /sys EPERM).
VIRTUAL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore",
    "efivarfs", "fusectl", "binfmt_misc", "devpts", "mqueue", "autofs", "nsfs",
})


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem ``path`` lives on (``"ext4"``, ``"tmpfs"``,
    ``"nfs4"``...): one stat of ``path``, then :func:`filesystem_type_of_dev`.

    >>> filesystem_type("/proc")
    'proc'
    """
    return filesystem_type_of_dev(os.stat(path).st_dev)


def filesystem_type_of_dev(dev: int) -> str:
    """The type of the mounted filesystem whose device is ``dev`` (a stat's
    ``st_dev``), from the kernel's ``/proc/self/mountinfo`` (proc(5): field 3
    is ``major:minor``, the type follows the `` - `` separator). A local read,
    no I/O on that filesystem, so the restart check can ask it about the
    stats it already took. ``""`` when unknown (no /proc, no such mount).
    """
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        if exc.errno in _FILE_LIMIT_ERRNOS:
            raise  # not "unknown": a tmpfs would pass for a filesystem whose stat sees every edit
        return ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 3 and fields[2] == want and right.split():
            return right.split()[0]
    return ""
