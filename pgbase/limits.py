"""The limits a process runs under, as the kernel keeps them: open files and memory.

Read, never assumed: ``RLIMIT_NOFILE`` (getrlimit(2)) and the descriptors
this process holds (``/proc/self/fd``); memory from the host
(``MemAvailable``, the kernel's own estimate, through psutil), the memory
cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, less the working
set as the kubelet counts it: usage minus inactive file pages), the
address-space limit (``RLIMIT_AS`` against ``VmSize``) and the mapping count
(``vm.max_map_count`` against ``/proc/self/maps``). :mod:`pgbase.oscause`
names these in messages; :mod:`preload.budget` decides with them.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path


def nofile_fix(at_least: int | None = None) -> str:
    """The fix for the open-file limit, in the words of the two places it is set.

    ``at_least``: the limit the work needs, where the caller counted it; else
    (an open that failed with EMFILE: the need is unknown) twice the soft
    limit now, at least systemd's 1024 for services: a number to paste."""
    n = at_least if at_least is not None else max(1024, 2 * min(open_file_limit()[0], 1 << 20))
    return (f"raise it where the process starts: `ulimit -n {n}` in its shell, `LimitNOFILE={n}` in its "
            "systemd unit (the default for services is 1024)")


def open_file_limit() -> tuple[int, int]:
    """``(soft, hard)`` of RLIMIT_NOFILE; unlimited reads as a very large int."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    big = 1 << 62
    return (big if soft == resource.RLIM_INFINITY else soft, big if hard == resource.RLIM_INFINITY else hard)


def open_files() -> int:
    """Descriptor numbers this process holds below its soft limit: an open
    fails with EMFILE exactly when every number below the soft limit is taken
    (a descriptor inherited above it takes no room). When even listing
    ``/proc/self/fd`` fails with EMFILE, every number is taken."""
    soft, _ = open_file_limit()
    try:
        # The listing holds one descriptor of its own while it reads.
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError as exc:
        import errno

        if exc.errno == errno.EMFILE:
            return soft
        raise
    return max(0, sum(1 for fd in fds if fd < soft) - 1)


def open_files_text() -> str:
    """``N files open, RLIMIT_NOFILE soft limit S (hard H)``: the facts an
    EMFILE message needs."""
    soft, hard = open_file_limit()
    return f"{open_files()} files open, RLIMIT_NOFILE soft limit {_n(soft)} (hard {_n(hard)})"


@dataclass(frozen=True)
class MemoryLimit:
    """One limit on the memory this process may still take.

    ``available``: bytes left under it now; ``name``: what it is, as an
    operator finds it (``MemAvailable``, ``cgroup memory.max``...);
    ``detail``: its figures; ``fix``: where it is raised.
    """

    name: str
    available: int
    detail: str
    fix: str


def memory_limits() -> list[MemoryLimit]:
    """Every memory limit that applies to this process now, host first."""
    import psutil

    vm = psutil.virtual_memory()
    out = [MemoryLimit("MemAvailable", int(vm.available),
                       f"MemAvailable {gib(vm.available)} of {gib(vm.total)}",
                       "free memory on this host (stop what holds it) or run on a larger one")]
    cg = _cgroup_limit()
    if cg is not None:
        out.append(cg)
    commit = _commit_limit()
    if commit is not None:
        out.append(commit)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vms = int(psutil.Process().memory_info().vms)
        out.append(MemoryLimit("RLIMIT_AS", max(0, soft - vms),
                               f"RLIMIT_AS {gib(soft)}, {gib(vms)} of address space in use",
                               "raise `ulimit -v` (LimitAS= in a systemd unit)"))
    return out


def _commit_limit() -> MemoryLimit | None:
    """Under strict overcommit (``vm.overcommit_memory=2``) an allocation
    fails past ``CommitLimit`` whatever is free (proc(5))."""
    try:
        if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "2":
            return None
        info = {k: int(v.split()[0]) * 1024 for k, _, v in
                (ln.partition(":") for ln in Path("/proc/meminfo").read_text().splitlines()) if v.strip()}
        limit, used = info["CommitLimit"], info["Committed_AS"]
    except (OSError, ValueError, KeyError):
        return None
    return MemoryLimit("CommitLimit", max(0, limit - used),
                       f"vm.overcommit_memory=2: Committed_AS {gib(used)} of CommitLimit {gib(limit)}",
                       "free memory, or raise vm.overcommit_ratio (sysctl)")


def map_count() -> tuple[int, int] | None:
    """``(mappings this process has, vm.max_map_count)``, None where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as f:
            n = sum(1 for _ in f)
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None
    return n, limit


def gib(n: float) -> str:
    """Bytes as people read them: ``1.50 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _n(limit: int) -> str:
    return "unlimited" if limit >= 1 << 62 else str(limit)


def _cgroup_limit() -> MemoryLimit | None:
    """The tightest memory cgroup limit on the way up from this process's
    cgroup, less its working set (usage minus inactive file pages: the
    kubelet's ``memory.available``); None when no cgroup limits memory."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best: MemoryLimit | None = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hid == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for base in _cgroup_dirs(mounts, path, v2):
            found = _read_cgroup(base, v2)
            if found is not None and (best is None or found.available < best.available):
                best = found
    return best


def _cgroup_dirs(mounts: list[str], path: str, v2: bool) -> list[Path]:
    """The cgroup's directory and each parent up to the mount (mountinfo(5):
    field 4 is the mount's root inside the hierarchy, field 5 its mount point)."""
    dirs: list[Path] = []
    for m in mounts:
        fields = m.split()
        if " - " not in m or len(fields) < 5:
            continue
        fstype, _, options = m.split(" - ", 1)[1].partition(" ")
        if v2 != (fstype == "cgroup2") or (not v2 and "memory" not in options.split(" ")[-1].split(",")):
            continue
        root, point = fields[3], Path(fields[4])
        if not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue
        rel = Path(path[len(root):].lstrip("/"))
        d = point / rel
        while True:
            dirs.append(d)
            if d == point:
                break
            d = d.parent
        break
    return dirs


def _read_cgroup(d: Path, v2: bool) -> MemoryLimit | None:
    limit_name, usage_name, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    try:
        raw = (d / limit_name).read_text().strip()
        if raw == "max":
            return None
        limit = int(raw)
        usage = int((d / usage_name).read_text())
        stats = dict(ln.split() for ln in (d / "memory.stat").read_text().splitlines() if len(ln.split()) == 2)
    except (OSError, ValueError):
        return None
    if limit >= 1 << 60:  # v1 writes "no limit" as a huge page-rounded number
        return None
    working = max(0, usage - int(stats.get(inactive, 0)))
    return MemoryLimit(f"cgroup {limit_name}", max(0, limit - working),
                       f"cgroup {limit_name} {gib(limit)} at {d}, working set {gib(working)}",
                       "raise the cgroup's limit (MemoryMax= in a systemd unit, the container's memory limit)")
