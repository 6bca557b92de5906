"""Where this user's daemons listen: a private registry of live socket roots.

``preload-gate status`` with no arguments must list every daemon of the
user, including one started under a custom ``--socket-root`` (the gate's
temporary roots, a CI pipeline's, ``preload CKPT --socket-root /tmp/x``).
Scanning the file system for them is neither possible nor safe, so each
daemon says where it is: its launcher writes one entry when every rank
serves and removes it when it stops::

    <cache dir>/daemons/<launcher pid>.json   (dir 0700, file 0600)
    {"socket_root": "/abs/root", "pid": 4242, "start_ticks": 123456, "digest": "..."}

One file per daemon, written atomically, so daemons never race on a shared
file. An entry whose process is gone (matched by pid *and* start time, so a
reused pid is not mistaken for it) is dead: a killed daemon's entry is
pruned by the next reader. Whoever can write this directory decides which
roots ``status`` looks in, so it gets the rule of socket directories and
manifests (:mod:`preload.trust`: ours, 0700/0600, no symlinks); a refused
entry or root is reported by name and never followed. An engine that finds
no socket in its own root asks the same registry (:func:`roots_serving`)
whether a daemon serves its digest under another root, to name that root.

The cache dir is ``$PRELOAD_GATE_CACHE``, else ``$XDG_CACHE_HOME/preload-gate``,
else ``~/.cache/preload-gate``: the place manifests live, so a daemon and an
operator that find the same manifests find the same registry.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgbase import atomic
from pgbase.errors import InsecureSocketError
from pgbase.oscause import FILE_LIMIT_ERRNOS
from preload import trust
from preload.daemon.home import inode_of, unlink_if

log = logging.getLogger("preload.daemon")


def registry_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache dir>/daemons``."""
    from preload.identity.manifest import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "daemons"


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``, proc(5)); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError as exc:
        if exc.errno in FILE_LIMIT_ERRNOS:
            raise  # not "no such process": a live daemon's entry would read as stale and be dropped
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Entry:
    """One registered daemon: its socket root and the launcher process."""

    path: Path
    socket_root: str
    pid: int
    start_ticks: int | None
    digest: str = ""

    def alive(self) -> bool:
        now = start_ticks(self.pid)
        return now is not None and now == self.start_ticks


@dataclass
class Registered:
    """What :func:`live_entries` found: live entries, and entries refused by name."""

    entries: list[Entry]
    refused: list[dict[str, str]]
    pruned: int = 0


def register(socket_root: str | os.PathLike[str], digest: str,
             cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Record this process as a daemon serving under ``socket_root`` (made
    absolute). Returns the entry's path, or None when it could not be
    written: serving does not depend on it, so that is one warning line
    naming what ``status`` then needs (``--socket-root``)."""
    root = os.path.abspath(socket_root)
    d = registry_dir(cache_dir)
    path = d / f"{os.getpid()}.json"
    try:
        d.parent.mkdir(0o700, parents=True, exist_ok=True)  # cache dir 0700: umask 002 made 0775
        trust.ensure_private_dir(d, "daemon registry")
        atomic.write_json(path, {"socket_root": root, "pid": os.getpid(), "start_ticks": start_ticks(os.getpid()),
                                  "digest": digest}, mode=0o600)
    except (OSError, trust.UntrustedPathError) as exc:
        log.warning("cannot register this daemon in %s (%s); `preload-gate status` lists it only with "
                    "--socket-root %s", d, exc, root)
        return None
    return path


def unregister(path: Path | None) -> None:
    """Remove this daemon's entry (only if it is still this process's)."""
    if path is None:
        return
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") != os.getpid():
            return
    except (OSError, ValueError):
        return
    unlink_if(path, inode_of(path))


def _read(path: Path) -> Entry:
    trust.verify_private_file(path, "daemon registry entry")
    obj: Any = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(obj, dict) or not isinstance(obj.get("socket_root"), str) or not isinstance(obj.get("pid"), int):
        raise ValueError("not a registry entry (socket_root, pid)")
    if not os.path.isabs(obj["socket_root"]):
        raise ValueError(f"socket root {obj['socket_root']!r} is not absolute")
    ticks = obj.get("start_ticks")
    return Entry(path, obj["socket_root"], obj["pid"], ticks if isinstance(ticks, int) else None,
                 str(obj.get("digest", "")))


def live_entries(cache_dir: str | os.PathLike[str] | None = None) -> Registered:
    """Every live daemon's entry; dead ones are removed, untrusted ones refused
    (listed with the reason, never followed, never removed: not ours)."""
    d = registry_dir(cache_dir)
    out = Registered([], [])
    if not os.path.lexists(d):
        return out
    try:
        trust.verify_private_dir(d, "daemon registry")
    except trust.UntrustedPathError as exc:
        out.refused.append({"path": str(d), "error": str(exc)})
        return out
    for path in sorted(d.glob("*.json")):
        inode = inode_of(path)
        try:
            entry = _read(path)
        except trust.UntrustedPathError as exc:
            out.refused.append({"path": str(path), "error": str(exc)})
            continue
        except (OSError, ValueError) as exc:
            out.refused.append({"path": str(path), "error": f"unreadable registry entry {path}: {exc}"})
            continue
        if entry.alive():
            out.entries.append(entry)
        elif unlink_if(path, inode):  # only the file we read, not one a new daemon just wrote
            out.pruned += 1
    return out


def live_roots(cache_dir: str | os.PathLike[str] | None = None) -> tuple[list[Path], list[dict[str, str]]]:
    """The distinct socket roots of live daemons that pass the socket-root
    trust check, and every refusal (entry or root) with its reason."""
    found = live_entries(cache_dir)
    roots: list[Path] = []
    refused = list(found.refused)
    for e in found.entries:
        root = Path(e.socket_root)
        if root in roots:
            continue
        try:
            trust.verify_private_dir(root, "socket root")
        except trust.UntrustedPathError as exc:
            refused.append({"path": str(e.path), "error": str(exc)})
            continue
        roots.append(root)
    return roots, refused


def roots_serving(digest: str, global_rank: int, cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The socket roots of live registered daemons whose socket directory
    for ``digest`` holds ``global_rank``'s socket: where to point an engine
    that found no socket in its own root, instead of starting a second
    resident copy. Only what :func:`live_roots` trusts is looked in, and the
    socket directory and socket pass the socket checks too; anything refused
    is skipped, never followed. Never raises: it only adds a hint to a miss
    line, so any failure is "none found"."""
    from preload.sockets import socket_dir, socket_path, verify_socket

    try:
        roots, _refused = live_roots(cache_dir)
        found = []
        for root in roots:
            try:
                verify_socket(socket_path(socket_dir(digest, root), global_rank))
            except (OSError, ValueError, InsecureSocketError):  # UntrustedPathError is one
                continue
            found.append(root)
        return found
    except Exception as exc:  # a hint must never fail a load
        log.debug("looking for other socket roots failed: %s: %s", type(exc).__name__, exc)
        return []
