"""systemd's file descriptor store as an :class:`~preload.daemon.fdstore.FdStore` (issue 26).

When the daemon runs as a unit with ``FileDescriptorStoreMax=`` above zero
(docs/examples/preload-gate-daemon@.service), the service manager itself
keeps the arena fds: a rank sends each one with ``sd_notify``
(``FDSTORE=1``, ``FDNAME=``, ``FDPOLL=0``) and systemd hands them back
to the unit's next main process through ``LISTEN_FDS``/``LISTEN_FDNAMES``.
The rules followed here are systemd's own (``sd_notify(3)``,
``sd_listen_fds(3)``, ``systemd.service(5)``, https://systemd.io/FILE_DESCRIPTOR_STORE/):

- The notify socket is ``$NOTIFY_SOCKET``: an ``AF_UNIX``/``SOCK_DGRAM``
  path, or an abstract name written with a leading ``@``. One datagram per
  message; fds ride as ``SCM_RIGHTS`` and systemd keeps its own duplicates.
- ``FDNAME=`` is at most 255 characters, printable ASCII, no ``:`` (the
  separator of ``LISTEN_FDNAMES``). All fds of one message get its one
  name, so every fd is its own message; a name is not replaced by a new
  push, so a deposit first sends ``FDSTOREREMOVE=1`` for its names.
- ``FDPOLL=0``: a memfd cannot be put in an epoll set, and an fd a
  manager polls for hangup could be dropped in the restart gap.
- Inherited fds start at 3 (``SD_LISTEN_FDS_START``), count
  ``$LISTEN_FDS``, and belong to us only when ``$LISTEN_PID`` is our pid
  (and ``$LISTEN_PIDFDID``, when set, our pidfd's inode); the variables are
  then removed so a child cannot adopt them again. Each taken fd gets
  ``FD_CLOEXEC``, as ``sd_listen_fds`` sets it.

Names: ``pg-<digest[:32]>-r<global rank>-<i>`` for the arena's fds and
``...-rec`` for the :class:`~preload.daemon.arena_record.ArenaRecord`,
itself a sealed memfd of JSON (``F_SEAL_WRITE|SHRINK|GROW|SEAL``), so the
record survives with the fds and no file on disk is needed. The record is
sent last: an arena without its record is incomplete and never adopted.

The main process of the unit is the launcher, and the ranks are its
children: the launcher takes the inherited fds (:func:`take_listen_fds`)
and passes them on to each rank (:meth:`Inherited.child_env`), checked by
the parent pid as systemd checks ``LISTEN_PID``. Ranks deposit from their
own pids, so the unit needs ``NotifyAccess=all``.

systemd offers a service no way to list its store; :meth:`SystemdStore.list`
shows what this process deposited (held) and what it inherited and has not
yet adopted (orphans, dropped once their ``orphan_ttl_s`` has passed since
this process started).
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from preload.daemon.arena_record import MAX_FDS_PER_RECORD, MAX_RECORD_BYTES, ArenaRecord
from preload.daemon.fdstore_base import MAX_ARENAS, FdStore, FdStoreError, StoredArena

log = logging.getLogger("preload.daemon.fdstore")

FDNAME_MAX = 255  # systemd's FDNAME_MAX
LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START
NOTIFY_BUFFER_MAX = 4096  # systemd reads at most PIPE_BUF bytes of one notify datagram
STORE_ENV = "PRELOAD_GATE_FDSTORE"  # "systemd": the unit keeps fds (set by the shipped unit)
# The launcher hands inherited fds on to its ranks with these (LISTEN_PID is
# the launcher's pid, not a rank's): the parent pid, the fd numbers, their names.
HANDOFF_PPID_ENV = "PRELOAD_GATE_LISTEN_PPID"
HANDOFF_FDS_ENV = "PRELOAD_GATE_LISTEN_FDS"
HANDOFF_NAMES_ENV = "PRELOAD_GATE_LISTEN_FDNAMES"
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_PIDFDID", "LISTEN_FDS", "LISTEN_FDNAMES")
_HANDOFF_VARS = (HANDOFF_PPID_ENV, HANDOFF_FDS_ENV, HANDOFF_NAMES_ENV)

_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SEAL, _F_SEAL_SHRINK, _F_SEAL_GROW, _F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
RECORD_SEALS = _F_SEAL_SEAL | _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_WRITE

_NAME_RE = re.compile(r"^pg-(?P<d>[0-9a-f]{32})-r(?P<rank>[0-9]+)-(?P<part>[0-9]+|rec)$")


def check_fdname(name: str) -> str:
    """``name`` if systemd accepts it as an ``FDNAME=`` (systemd's
    ``fdname_is_valid``: at most 255 characters, printable ASCII, no ``:``);
    else FdStoreError naming the rule."""
    if len(name) > FDNAME_MAX:
        raise FdStoreError(
            f"fd name {name[:40]!r}... is {len(name)} characters; systemd's FDNAME= takes at most "
            f"{FDNAME_MAX}"
        )
    if ":" in name:
        raise FdStoreError(
            f"fd name {name!r} contains ':', the separator of LISTEN_FDNAMES; systemd refuses it"
        )
    bad = next((c for c in name if not " " <= c < "\x7f"), None)
    if bad is not None:
        raise FdStoreError(
            f"fd name {name!r} contains {bad!r}; systemd's FDNAME= takes printable ASCII only"
        )
    return name


def fd_names(digest: str, global_rank: int, nfds: int) -> tuple[list[str], str]:
    """The names of one rank's arena fds and of its record."""
    base = f"pg-{digest[:32]}-r{global_rank}"
    return [check_fdname(f"{base}-{i}") for i in range(nfds)], check_fdname(f"{base}-rec")


def _address(notify_socket: str) -> str:
    """``$NOTIFY_SOCKET`` as ``socket.sendmsg`` takes it (``@name``: abstract)."""
    if notify_socket.startswith("@"):
        return "\0" + notify_socket[1:]
    if notify_socket.startswith("/"):
        return notify_socket
    raise FdStoreError(
        f"NOTIFY_SOCKET={notify_socket!r} is neither a path nor an abstract '@' name (a vsock "
        "address is not supported); run the daemon under a local systemd unit, or unset "
        f"{STORE_ENV} to use the keeper"
    )


def sd_notify(state: str, fds: Iterable[int] = (), notify_socket: str | None = None) -> None:
    """Send one ``sd_notify`` message (``KEY=VALUE`` lines) with ``fds`` as
    SCM_RIGHTS to ``notify_socket`` (default ``$NOTIFY_SOCKET``). Every
    ``FDNAME=`` in it is checked first. Raises FdStoreError when no socket
    is set or the send fails."""
    path = notify_socket if notify_socket is not None else os.environ.get("NOTIFY_SOCKET")
    if not path:
        raise FdStoreError(
            "NOTIFY_SOCKET is not set: this process does not run under a systemd unit (Type=notify); "
            f"unset {STORE_ENV} to use the keeper"
        )
    fds = list(fds)
    for line in state.splitlines():
        if line.startswith("FDNAME="):
            check_fdname(line.removeprefix("FDNAME="))
    data = state.encode()
    if len(data) > NOTIFY_BUFFER_MAX:
        raise FdStoreError(
            f"notify message of {len(data)} bytes; systemd reads at most {NOTIFY_BUFFER_MAX}"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            # sendmsg, not socket.send_fds: before Python 3.12 that one drops the address.
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            s.sendmsg([data], rights, 0, _address(path))
        except OSError as exc:
            raise FdStoreError(
                f"sd_notify to NOTIFY_SOCKET={path}: {exc.strerror or exc}; is the unit running "
                "with Type=notify and NotifyAccess=all?"
            ) from exc


def notify_ready(status: str, environ: Mapping[str, str] | None = None) -> bool:
    """``READY=1`` (and ``STATUS=``) to the service manager when one listens
    (``$NOTIFY_SOCKET`` set); False when none does. A send that fails is
    logged, not raised: the daemon serves either way."""
    env = os.environ if environ is None else environ
    if not env.get("NOTIFY_SOCKET"):
        return False
    try:
        sd_notify(
            f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}", notify_socket=env["NOTIFY_SOCKET"]
        )
    except FdStoreError as exc:
        log.error("could not tell systemd the daemon is ready: %s", exc)
        return False
    return True


# ------------------------------------------------------------------ inherited fds


@dataclass
class Inherited:
    """The fds a service manager (or the launcher) passed us, by name; the
    caller owns and closes them."""

    fds: dict[str, list[int]] = field(default_factory=dict)
    at: float = field(default_factory=time.time)  # when taken: orphans' TTLs run from here

    def all_fds(self) -> list[int]:
        return [fd for fds in self.fds.values() for fd in fds]

    def child_env(self) -> dict[str, str]:
        """What a child (a rank) needs in its environment to take these fds,
        which it must inherit under the same numbers (``pass_fds``)."""
        pairs = [(name, fd) for name, fds in self.fds.items() for fd in fds]
        if not pairs:
            return {}
        return {
            HANDOFF_PPID_ENV: str(os.getpid()),
            HANDOFF_FDS_ENV: ",".join(str(fd) for _, fd in pairs),
            HANDOFF_NAMES_ENV: ":".join(name for name, _ in pairs),
        }

    def close(self) -> None:
        for fd in self.all_fds():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def _our_pidfd_inode() -> int | None:
    try:
        pidfd = os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return None
    try:
        return os.fstat(pidfd).st_ino
    finally:
        os.close(pidfd)


def take_listen_fds(environ: MutableMapping[str, str] | None = None) -> Inherited:
    """The fds passed to this process, by name: systemd's (``LISTEN_PID`` our
    pid, fds 3.. counted by ``LISTEN_FDS``, named by ``LISTEN_FDNAMES``)
    or, in a rank, its launcher's (:meth:`Inherited.child_env`, checked
    against our parent pid). The variables are removed from ``environ``
    (default ``os.environ``) whatever they said, so no child adopts them again.
    Fds meant for another pid are not touched. Raises FdStoreError when the
    variables are malformed."""
    env = os.environ if environ is None else environ
    got = {k: env.pop(k) for k in (*_LISTEN_VARS, *_HANDOFF_VARS) if k in env}
    out = Inherited()
    if HANDOFF_PPID_ENV in got:
        if got[HANDOFF_PPID_ENV] != str(os.getppid()):
            return out  # meant for another process (we were started by someone else)
        fds = [_int(x, HANDOFF_FDS_ENV) for x in got.get(HANDOFF_FDS_ENV, "").split(",") if x]
        names = got.get(HANDOFF_NAMES_ENV, "").split(":") if fds else []
    elif "LISTEN_PID" in got:
        if got["LISTEN_PID"] != str(os.getpid()):
            return out  # sd_listen_fds: not ours
        if "LISTEN_PIDFDID" in got:
            inode = _our_pidfd_inode()
            if inode is not None and got["LISTEN_PIDFDID"] != str(inode):
                return out
        n = _int(got.get("LISTEN_FDS", "0"), "LISTEN_FDS")
        fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + n))
        names = got["LISTEN_FDNAMES"].split(":") if "LISTEN_FDNAMES" in got else ["unknown"] * n
    else:
        return out
    if len(names) != len(fds):
        raise FdStoreError(
            f"{len(fds)} inherited fds but {len(names)} names in LISTEN_FDNAMES; the service "
            "manager's environment is inconsistent"
        )
    for fd, name in zip(fds, names, strict=True):
        try:
            os.set_inheritable(fd, False)
        except OSError as exc:
            raise FdStoreError(f"inherited fd {fd} ({name}) is not open: {exc.strerror}") from exc
        out.fds.setdefault(name, []).append(fd)
    return out


def _int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise FdStoreError(f"${what}={text!r} is not a non-negative number")
    return value


# ------------------------------------------------------------------ the record as a sealed memfd


def record_memfd(record: ArenaRecord) -> int:
    """A sealed memfd holding ``record`` as JSON (the caller closes it)."""
    data = json.dumps(record.to_json(), separators=(",", ":")).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise FdStoreError(
            f"arena record of rank {record.global_rank} is {len(data)} bytes; the store takes at "
            f"most {MAX_RECORD_BYTES}"
        )
    fd = os.memfd_create("preload-gate-record", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, _F_ADD_SEALS, RECORD_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_record(fd: int, name: str) -> ArenaRecord:
    """The record in a stored memfd, which must carry the write seal (its
    bytes are those deposited). Raises FdStoreError naming ``name``."""
    try:
        seals = fcntl.fcntl(fd, _F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise FdStoreError(f"stored record {name}: not a sealable memfd ({exc.strerror})") from exc
    if seals & RECORD_SEALS != RECORD_SEALS:
        raise FdStoreError(
            f"stored record {name}: seals {seals:#x} lack F_SEAL_WRITE|SHRINK|GROW|SEAL; its bytes "
            "could have changed since the deposit"
        )
    if size > MAX_RECORD_BYTES:
        raise FdStoreError(f"stored record {name}: {size} bytes, more than {MAX_RECORD_BYTES}")
    chunks, off = [], 0
    while off < size:
        chunk = os.pread(fd, size - off, off)
        if not chunk:
            break
        chunks.append(chunk)
        off += len(chunk)
    try:
        return ArenaRecord.from_json(json.loads(b"".join(chunks)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise FdStoreError(f"stored record {name}: {exc}") from exc


# ------------------------------------------------------------------ the store


@dataclass
class _Entry:
    record: ArenaRecord
    names: list[str]
    rec_name: str
    fds: list[int] = field(default_factory=list)  # inherited copies we hold (deposited ones: none)
    held: bool = False  # deposited by this process


class SystemdStore(FdStore):
    """systemd's fd store, seen from one process of the unit.

    Example (a rank of a unit that keeps fds)::

        store = SystemdStore.from_environment()
        found = store.fetch(digest, rank)      # None: nothing inherited
        store.deposit(record, arena_fds)       # after loading or adopting
    """

    name = "systemd"

    def __init__(self, notify_socket: str, inherited: Inherited | None = None) -> None:
        _address(notify_socket)
        self.notify_socket = notify_socket
        self._inherited_at = inherited.at if inherited is not None else time.time()
        self._entries: dict[tuple[str, int], _Entry] = {}
        if inherited is not None:
            self._adopt_inherited(inherited)

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> SystemdStore:
        """The store of the unit this process runs in: ``$NOTIFY_SOCKET`` and
        the fds passed to it (:func:`take_listen_fds`, which clears the
        variables). Raises FdStoreError when ``$NOTIFY_SOCKET`` is unset."""
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET")
        if not path:
            raise FdStoreError(
                f"{STORE_ENV}=systemd but NOTIFY_SOCKET is not set: run the daemon under the unit in "
                "docs/examples/preload-gate-daemon@.service (Type=notify), or unset "
                f"{STORE_ENV} to use the keeper"
            )
        return cls(path, take_listen_fds(env))

    # -- inherited fds -> entries

    def _adopt_inherited(self, inherited: Inherited) -> None:
        groups: dict[tuple[str, int], dict[str, list[int]]] = {}
        for name, fds in inherited.fds.items():
            m = _NAME_RE.match(name)
            if m is None:
                continue  # not ours (another fd of the unit): left as it is
            groups.setdefault((m["d"], int(m["rank"])), {})[name] = fds
        for (d32, rank), named in groups.items():
            rec_name = f"pg-{d32}-r{rank}-rec"
            try:
                rec_fds = named.get(rec_name) or []
                if len(rec_fds) != 1:
                    raise FdStoreError(
                        f"{rank}: {len(rec_fds)} record fds named {rec_name} (want 1)"
                    )
                record = read_record(rec_fds[0], rec_name)
                names, _ = fd_names(record.digest, record.global_rank, record.nfds)
                if record.digest[:32] != d32 or record.global_rank != rank:
                    raise FdStoreError(
                        f"record {rec_name} names digest {record.digest} rank {record.global_rank}"
                    )
                missing = [n for n in names if len(named.get(n) or []) != 1]
                if missing:
                    raise FdStoreError(
                        f"record {rec_name} names {record.nfds} fds but {missing} did not come back "
                        "(FileDescriptorStoreMax= too small?)"
                    )
                extra = sorted(set(named) - {*names, rec_name})
                if extra:
                    raise FdStoreError(
                        f"record {rec_name} names {record.nfds} fds but {extra} came back too"
                    )
            except FdStoreError as exc:
                log.error("systemd fd store: dropping rank %d of digest %s...: %s", rank, d32, exc)
                for n, fds in named.items():
                    for fd in fds:
                        os.close(fd)
                    try:
                        self._remove_name(n)
                    except FdStoreError as why:
                        log.error("systemd fd store: could not remove %s: %s", n, why)
                continue
            os.close(rec_fds[0])
            self._entries[(record.digest, rank)] = _Entry(
                record, names, rec_name, fds=[named[n][0] for n in names]
            )
        if len(self._entries) > MAX_ARENAS:
            log.warning(
                "systemd fd store passed back %d arenas, more than %d",
                len(self._entries),
                MAX_ARENAS,
            )

    def _expire(self) -> None:
        """Drop inherited arenas nobody adopted within their ``orphan_ttl_s``."""
        now = time.time()
        for key, e in list(self._entries.items()):
            ttl = e.record.orphan_ttl_s
            if not e.held and ttl > 0 and now - self._inherited_at > ttl:
                log.info(
                    "systemd fd store: rank %d of %s not adopted within %g s; dropped",
                    key[1],
                    key[0],
                    ttl,
                )
                self._forget(key)

    # -- messages

    def _remove_name(self, name: str) -> None:
        sd_notify(f"FDSTOREREMOVE=1\nFDNAME={name}", notify_socket=self.notify_socket)

    def _forget(self, key: tuple[str, int]) -> _Entry | None:
        e = self._entries.pop(key, None)
        if e is None:
            return None
        for name in (*e.names, e.rec_name):
            self._remove_name(name)
        for fd in e.fds:
            os.close(fd)
        return e

    # -- FdStore

    def deposit(self, record: ArenaRecord, fds: list[int]) -> None:
        if len(fds) != record.nfds:
            raise FdStoreError(
                f"deposit of rank {record.global_rank}: {len(fds)} fds but its record names "
                f"{record.nfds}"
            )
        if len(fds) > MAX_FDS_PER_RECORD:
            raise FdStoreError(
                f"deposit of rank {record.global_rank}: {len(fds)} fds, more than {MAX_FDS_PER_RECORD}"
            )
        key = (record.digest, record.global_rank)
        if key not in self._entries and len(self._entries) >= MAX_ARENAS:
            raise FdStoreError(
                f"the store holds {MAX_ARENAS} arenas already; run preload-gate stop for a digest "
                "no longer served"
            )
        for fd in fds:
            mode = os.fstat(fd).st_mode  # an fd that is not open fails here, by number
            if stat.S_ISDIR(mode):
                raise FdStoreError(f"deposit of rank {record.global_rank}: fd {fd} is a directory")
        names, rec_name = fd_names(record.digest, record.global_rank, record.nfds)
        old = self._entries.pop(key, None)
        for name in dict.fromkeys([*(old.names if old else []), *names, rec_name]):
            self._remove_name(name)  # a push adds beside a same-named fd; it does not replace it
        if old is not None:
            for fd in old.fds:
                os.close(fd)
        rec_fd = record_memfd(record)
        try:
            for name, fd in zip(names, fds, strict=True):
                sd_notify(f"FDSTORE=1\nFDPOLL=0\nFDNAME={name}", [fd], self.notify_socket)
            sd_notify(
                f"FDSTORE=1\nFDPOLL=0\nFDNAME={rec_name}", [rec_fd], self.notify_socket
            )  # last: complete
        finally:
            os.close(rec_fd)
        self._entries[key] = _Entry(record, names, rec_name, held=True)

    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        self._expire()
        e = self._entries.get((digest, global_rank))
        if e is None or e.held:
            return None
        return StoredArena(
            record=e.record,
            fds=[os.dup(fd) for fd in e.fds],
            held=False,
            extra={"store": self.name, "names": [*e.names, e.rec_name]},
        )

    def release(self, digest: str, global_rank: int) -> None:
        self._forget((digest, global_rank))

    def drop(
        self, digest: str | None = None, global_rank: int | None = None
    ) -> list[dict[str, Any]]:
        out = []
        for key in [
            k
            for k in self._entries
            if (digest is None or k[0] == digest) and (global_rank is None or k[1] == global_rank)
        ]:
            e = self._forget(key)
            if e is not None:
                out.append({**e.record.summary(), "held": e.held})
        return out

    def list(self) -> list[dict[str, Any]]:
        self._expire()
        now = time.time()
        out = []
        for e in self._entries.values():
            ttl = e.record.orphan_ttl_s
            left = None if e.held or ttl == 0 else max(0.0, ttl - (now - self._inherited_at))
            out.append(
                {**e.record.summary(), "held": e.held, "ttl_left_s": left, "store": self.name}
            )
        return out

    def close(self) -> None:
        """Close our copies; systemd keeps its own until removed or the unit stops for good."""
        for e in self._entries.values():
            for fd in e.fds:
                os.close(fd)
            e.fds = []
        self._entries.clear()
