"""``preload-gate stop``: stop a digest's daemons for good and evict its arenas from the fd store.

A daemon is found as ``status`` finds it (:func:`preload.daemon.status.scan`
of one socket root: every rank socket that answers ``stats``) and stopped by
its launcher's own stop path: SIGTERM to the launcher, which stops its ranks
(sockets, locks and the emptied socket directory removed); a rank whose
parent is not a ``preload-gate preload`` launcher is sent SIGTERM itself.
Only processes of this user whose command line is ours are signalled, and
psutil's start time guards against a pid reused meanwhile
(:func:`pgbase.procs.stop_pid`; SIGKILL only after ``timeout_s``).

Then the digest's arenas are dropped from the store
(:func:`preload.daemon.fdstore.open_store` with ``start=False``: None means
no store runs, so nothing is stored), whether or not a daemon still served
them: eviction is explicit (issue 26).

A target is a checkpoint directory (its daemons, the stored arenas whose
record names its real path, and the digest its promotion manifest names);
a path no longer there that a daemon or stored arena recorded (its folder
renamed since: what ``status`` shows); or a digest: 64 hex characters, or
a prefix of at least 16 (the socket directory's name, as ``status`` prints
it) that must name one digest.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pgbase.digest_text import short_digest
from pgbase.errors import PreloadGateError
from preload.daemon.status import DaemonRecord

FORMAT = "preload-gate-stop/1"
TERM_S = 30.0  # a launcher stops its ranks within 15 s (Launcher.stop); then SIGKILL
KILL_S = 5.0
_HEX = re.compile(r"^[0-9a-f]{16,64}$")


class StopError(PreloadGateError):
    """The target names nothing we can stop (bad input, or an ambiguous digest prefix)."""


@dataclass(frozen=True)
class Target:
    """What to stop: ``checkpoint`` (its real path), ``digest`` (a prefix of
    16..64 hex), or everything (``all``)."""

    checkpoint: str | None = None
    digest: str | None = None
    all: bool = False
    # The value as typed when no folder is there now: a daemon whose recorded
    # checkpoint is that path (its folder renamed or removed since) is still
    # stopped by it, as status shows it; nothing matching is a refusal.
    gone: str | None = None

    def __str__(self) -> str:
        return "everything" if self.all else self.checkpoint or str(self.digest)


def parse_target(value: str | None, all_: bool) -> Target:
    """``stop``'s positional argument and ``--all`` as a :class:`Target`;
    StopError (one line, exit 2) for neither, both, or a file. A value that
    is neither a directory nor a digest is kept as the path a daemon may
    have recorded (:attr:`Target.gone`); :func:`stop` refuses it when no
    daemon or stored arena names it."""
    if all_ and value:
        raise StopError(
            f"give a digest or checkpoint, or --all, not both (got {value!r} and --all)"
        )
    if all_:
        return Target(all=True)
    if not value:
        raise StopError(
            "name what to stop: a checkpoint directory, a digest (as promote or status prints it), "
            "or --all"
        )
    if os.path.isdir(value):
        return Target(checkpoint=os.path.realpath(value))
    if _HEX.match(value):
        return Target(digest=value)
    if os.path.lexists(value):
        raise StopError(f"{value} is not a directory; name a checkpoint directory or a digest")
    return Target(checkpoint=os.path.realpath(value), gone=value)


def _not_found(target: Target) -> StopError:
    return StopError(
        f"{target.gone!r} is neither a checkpoint directory nor a digest (64 hex, or the first 16 or more "
        "as status prints them), and no daemon's recorded checkpoint is "
        f"{target.checkpoint}; run preload-gate status to see each daemon's digest and checkpoint"
    )


class Stopped(msgspec.Struct):
    """One rank that served the target and what became of it."""

    digest: str
    rank: int
    pid: int
    signalled: int | None  # the pid sent SIGTERM (its launcher, or the rank itself); None: refused
    stopped: bool
    bytes: int
    checkpoint: str
    why: str = ""  # not stopped: why


class StopReport(msgspec.Struct):
    """``stop --json``: ranks stopped (or not), arenas dropped, the store asked."""

    target: str
    socket_root: str
    stopped: list[Stopped]
    dropped: list[dict[str, Any]]
    store: str | None  # "keeper" | "systemd"; None: no store runs
    format: str = FORMAT
    # Stale rank sockets of the target removed (nothing answered, no live
    # process held the lock: a daemon killed -9 left them; issue 39).
    removed: list[str] = msgspec.field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(not s.stopped for s in self.stopped)


def _matches(target: Target, digest: str | None, checkpoint: str | None) -> bool:
    if target.all:
        return True
    if target.digest is not None:
        return bool(digest) and str(digest).startswith(target.digest)
    return bool(checkpoint) and os.path.realpath(str(checkpoint)) == target.checkpoint


def _manifest_digest(checkpoint: str) -> str | None:
    """The digest the checkpoint's promotion manifest names (None without one)."""
    from preload.identity.manifest import load_manifest

    try:
        m = load_manifest(checkpoint)
    except PreloadGateError:
        return None
    return m.digest if m is not None else None


@dataclass
class _Process:
    pid: int
    why: str = ""
    ok: bool = field(default=False)


def _ours(pid: int | None, marks: tuple[str, ...], started_before: float | None = None) -> _Process:
    """Whether ``pid`` is a process of this user whose command line holds one of ``marks``."""
    import psutil

    if pid is None or pid <= 1:
        return _Process(pid or 0, "no such process")
    try:
        p = psutil.Process(pid)
        uid, argv, created = p.uids().real, p.cmdline(), p.create_time()
    except (psutil.Error, OSError) as exc:
        return _Process(pid, f"cannot read pid {pid}: {type(exc).__name__}")
    if uid != os.getuid():
        return _Process(pid, f"pid {pid} belongs to uid {uid}, not to us")
    if not any(m in argv[1:] for m in marks):
        return _Process(pid, f"pid {pid} is not a preload-gate daemon ({' '.join(argv[:4])})")
    if started_before is not None and created > started_before + 2.0:
        return _Process(pid, f"pid {pid} started after the daemon did (the pid was reused)")
    return _Process(pid, ok=True)


def _stop_launcher(ranks: list[DaemonRecord], timeout_s: float) -> list[Stopped]:
    """Stop the ranks of one launcher: SIGTERM it (its stop path) when it is
    ``preload-gate preload``, else each rank; then make sure each rank is gone."""
    import psutil

    from pgbase.procs import stop_pid

    now = time.time()
    first = min(now - r.uptime_s for r in ranks)
    # Who is who, before anything is signalled.
    checked = [
        _ours(r.pid, ("preload.daemon.rank",), started_before=now - r.uptime_s) for r in ranks
    ]
    launcher = _ours(ranks[0].launcher_pid, ("preload",), started_before=first)
    if launcher.ok:
        stop_pid(launcher.pid, term_s=timeout_s, kill_s=KILL_S)
    out = []
    for r, rank in zip(ranks, checked, strict=True):
        pid = int(r.pid or 0)
        signalled: int | None
        if rank.ok:  # gone already when its launcher stopped it; else SIGTERM it now
            gone, signalled = (
                stop_pid(pid, term_s=timeout_s, kill_s=KILL_S),
                launcher.pid if launcher.ok else pid,
            )
        else:
            gone, signalled = (
                launcher.ok and not psutil.pid_exists(pid),
                launcher.pid if launcher.ok else None,
            )
        why = (
            ""
            if gone
            else (
                rank.why
                if signalled is None
                else f"pid {pid} still runs after SIGTERM and SIGKILL; see: ps -p {pid}"
            )
        )
        out.append(
            Stopped(
                digest=str(r.digest),
                rank=int(r.rank or 0),
                pid=pid,
                signalled=signalled,
                stopped=gone,
                bytes=r.resident_bytes,
                checkpoint=str(r.checkpoint or ""),
                why=why,
            )
        )
    return out


def _stale(r: DaemonRecord) -> bool:
    """A rank socket nothing answers on and whose lock no live process holds."""
    return not (r.serving or r.busy or r.refused or r.not_a_socket or r.lock_holder)


def _stale_of(target: Target, records: list[DaemonRecord], wanted: set[str]) -> list[DaemonRecord]:
    """The target's stale sockets: their directory is ``<digest[:16]>``."""
    prefixes = {d[:16] for d in wanted} | ({target.digest[:16]} if target.digest else set())
    return [r for r in records if _stale(r) and (target.all or Path(r.socket).parent.name in prefixes)]


def _remove_stale(records: list[DaemonRecord]) -> list[str]:
    """Remove each stale socket (checked once more: a daemon may have bound it
    since) and its directory when that leaves it empty."""
    from preload.daemon.home import remove_if_empty
    from preload.daemon.lock import lock_holder, socket_answers

    removed = []
    for r in records:
        sock = Path(r.socket)
        rank = int(sock.stem.removeprefix("rank"))
        if socket_answers(sock) or lock_holder(sock.parent, rank) is not None:
            continue
        try:
            sock.unlink()
        except OSError:
            continue
        removed.append(str(sock))
        remove_if_empty(sock.parent)
    return removed


def stop(
    target: Target, socket_root: str | os.PathLike[str], timeout_s: float = TERM_S,
    announce: Callable[[str], None] | None = None,
) -> StopReport:
    """Stop the target's daemons under ``socket_root`` and drop its arenas from
    the store; the report of both. ``announce`` is told, before anything is
    signalled or dropped, what ``--all`` is about to stop (one line).
    Raises StopError for a digest prefix that names more than one digest,
    FdStoreError when a store runs but fails."""
    from preload.daemon import fdstore, status

    root = Path(socket_root)
    scanned = status.scan(root)
    ranks = [r for r in scanned if r.serving and _matches(target, r.digest, r.checkpoint)]
    store = fdstore.open_store(str(root), start=False)
    try:
        stored = store.list() if store is not None else []
        wanted = {str(r.digest) for r in ranks} | {
            str(a["digest"])
            for a in stored
            if _matches(target, a.get("digest"), a.get("checkpoint"))
        }
        if target.gone is not None and not wanted:
            raise _not_found(target)  # before anything is signalled or dropped
        if target.checkpoint is not None:
            manifest = _manifest_digest(target.checkpoint)
            if manifest is not None:
                wanted.add(manifest)
        if target.digest is not None and len(wanted) > 1:
            raise StopError(
                f"digest prefix {target.digest} names {len(wanted)} digests "
                f"({', '.join(sorted(short_digest(d) + '...' for d in wanted))}); give more of it"
            )
        stale = _stale_of(target, scanned, wanted)
        if target.all and announce is not None:
            announce(plan_line(root, ranks, stored, stale))
        by_launcher: dict[int | None, list[DaemonRecord]] = {}
        for r in ranks:
            by_launcher.setdefault(r.launcher_pid, []).append(r)
        stopped = [s for group in by_launcher.values() for s in _stop_launcher(group, timeout_s)]
        dropped: list[dict[str, Any]] = []
        if store is not None:
            if target.all:
                dropped = store.drop()
            else:
                for d in sorted(wanted):
                    dropped += store.drop(d)
        return StopReport(
            target=str(target),
            socket_root=str(root),
            stopped=stopped,
            dropped=dropped,
            store=store.name if store is not None else None,
            removed=_remove_stale(stale),
        )
    finally:
        if store is not None:
            store.close()


def plan_line(root: Path, ranks: list[DaemonRecord], stored: list[dict[str, Any]],
              stale: list[DaemonRecord]) -> str:
    """What ``stop --all`` is about to do, said before it does it."""
    digests = sorted({str(r.digest) for r in ranks} | {str(a.get("digest")) for a in stored})
    named = ", ".join(short_digest(d) for d in digests) or "none"
    total = sum(int(a.get("bytes") or 0) for a in stored)
    return (f"stop --all: stopping {len(ranks)} daemon rank(s) and taking {len(stored)} stored arena(s) "
            f"({total} bytes) out of the fd store under {root}, digests: {named}; {len(stale)} stale socket(s) "
            "to remove")


def render(report: StopReport) -> list[str]:
    """The lines ``stop`` prints."""
    lines = [f"removed stale socket {sock} (nothing answered on it and its lock was free)"
             for sock in report.removed]
    for s in report.stopped:
        if s.stopped:
            by = "" if s.signalled in (None, s.pid) else f" (via its launcher, pid {s.signalled})"
            lines.append(
                f"stopped {short_digest(s.digest)} rank {s.rank} pid {s.pid}{by}: {s.bytes} bytes resident  "
                f"{s.checkpoint}"
            )
        else:
            lines.append(
                f"not stopped: {short_digest(s.digest)} rank {s.rank} pid {s.pid}: {s.why}"
            )
    for a in report.dropped:
        held = "held" if a.get("held") else "orphan"
        lines.append(
            f"dropped {short_digest(str(a['digest']))} rank {a['rank']} {a.get('stage')}/{a.get('transport')} "
            f"{a.get('bytes')} bytes ({held}, {a.get('origin')} gen {a.get('generation')}) from the "
            f"{report.store} store  {a.get('checkpoint') or ''}".rstrip()
        )
    if not report.stopped and not report.dropped and not report.removed:
        store = (
            "no fd store runs" if report.store is None else f"the {report.store} store holds none"
        )
        lines.append(
            f"nothing to stop for {report.target}: no daemon of it serves under {report.socket_root} "
            f"and {store}"
        )
    elif report.dropped or report.stopped:
        total = sum(int(a.get("bytes") or 0) for a in report.dropped)
        lines.append(
            f"{sum(s.stopped for s in report.stopped)} rank(s) stopped, {len(report.dropped)} arena(s) "
            f"dropped ({total} bytes)"
        )
    return lines
