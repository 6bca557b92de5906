"""The rollout's state file and the host lock.

The state file is the one record of which checkpoint each replica serves.
It is written atomically (:mod:`pgbase.atomic`, 0600) *before* a replica is
touched (its ``phase`` says what is about to happen and ``target`` onto
what) and again once the step is proven, so a rollout killed at any point
(``kill -9``) leaves a file that names every replica's weights but at most
one's, and names that one's two candidates (``serving`` and ``target``).
Replicas move one at a time, so "two replicas on unknown weights" cannot
be written down.

Phases of a replica:

- ``serving``: it serves ``serving`` (a digest), proven by its load event
  and its canary;
- ``starting``: brought up onto ``target`` from nothing (a new replica):
  it serves ``target`` or nothing;
- ``switching``: it is being restarted onto ``target``; it serves
  ``serving``, ``target`` or nothing;
- ``rolling_back``: the same, back onto ``target`` (the checkpoint it left);
- ``down``: it serves nothing (a rollback that failed too); the report
  says so.

One rollout per host at a time: ``flock`` on ``<cache dir>/rollout.lock``
(:mod:`pgbase.lockfile`), holder pid and time written into it; a second run
is refused naming them. The lock is the kernel's, so a rollout killed with
``kill -9`` frees it.

>>> state = load_state(Path("/var/lib/pg/rollout/state.json"))  # doctest: +SKIP
>>> [r.serving[:8] for r in state.replicas]  # doctest: +SKIP
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pgbase import atomic
from pgbase.errors import PreloadGateError
from pgbase.json_shape import convert
from pgbase.lockfile import open_lock_file, read_holder, record_holder

FORMAT = "preload-gate-rollout/1"
PHASES = ("serving", "starting", "switching", "rolling_back", "down")
STATUSES = ("running", "done", "failed")


def label_of(index: int) -> str:
    """The name of the ``index``-th checkpoint of a sequence: A, B, C, ..."""
    return chr(ord("A") + index) if index < 26 else f"#{index}"


class StateError(PreloadGateError):
    """The state file cannot be read, or records another rollout."""


class RolloutLockedError(PreloadGateError):
    """Another rollout holds this host's lock."""


@dataclass
class Checkpoint:
    """One checkpoint of the sequence: its real path, content digest and golden file.

    ``key`` is what the state records replicas serving: the checkpoint's
    identity, what decides its answers (:func:`harness.rollout.identity.identity`:
    the weights digest, the config digest and the answer files, the rule the
    golden keys by), so a config-only change is another checkpoint. ``ask``
    is the digest replicas ask the daemon for: the content digest, except
    under the ``header_only`` negative control (vLLM's header hash).
    ``config_digest``: config.json's (what a daemon's key must hold for the
    replicas to hit); ``socket_root``: where its daemon lives when not under
    the rollout's own root (a second checkpoint of the same weights: the
    socket directory is keyed by the digest, one daemon each).
    """

    path: str
    digest: str
    golden: str | None = None
    key: str = ""
    ask: str = ""
    config_digest: str | None = None
    socket_root: str = ""

    def __post_init__(self) -> None:
        self.ask = self.ask or self.digest
        self.key = self.key or self.ask

    def root(self, default: str) -> str:
        """Where its daemon lives: its own ``socket_root``, else the rollout's ``default``."""
        return self.socket_root or default


@dataclass
class ReplicaRecord:
    """One replica as the state file knows it.

    ``serving`` is the digest it serves (None: nothing, or not known yet);
    ``pid``/``start_ticks`` name the process of a supervised replica (the
    start time guards against a reused pid); ``events_file`` is where its
    loader writes its load events.
    """

    index: int
    url: str
    events_file: str
    serving: str | None = None
    phase: str = "serving"
    target: str | None = None
    pid: int | None = None
    start_ticks: int | None = None
    log: str | None = None
    # The in-flight start: what its process was started onto, and how many
    # load events the file held before it (a resumed run waits for that
    # process instead of restarting it).
    started_onto: str | None = None
    events_seen: int = 0


@dataclass
class DaemonRecord:
    """A daemon holding one checkpoint: its launcher pid and who started it."""

    digest: str
    checkpoint: str
    pid: int
    start_ticks: int | None
    socket_root: str
    started_here: bool
    resident_bytes: int = 0
    released: bool = False
    key: str = ""  # the checkpoint (its identity, Checkpoint.key) it holds; "" in older files: the digest

    def __post_init__(self) -> None:
        self.key = self.key or self.digest


@dataclass
class RolloutState:
    """Everything a rollout has done, as the state file records it."""

    id: str
    host: str
    sequence: list[Checkpoint]
    replicas: list[ReplicaRecord]
    settings: dict[str, Any]
    engine_args: list[str]
    driver: dict[str, Any]
    format: str = FORMAT
    step: int = 1  # the index in ``sequence`` of the checkpoint being rolled onto
    status: str = "running"
    daemons: list[DaemonRecord] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)
    switches: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    created: float = 0.0
    updated: float = 0.0
    # Names the fleet across rollouts on one state file (a supervised
    # replica's process mark): a new rollout of the same replicas keeps it.
    fleet_id: str = ""

    @classmethod
    def new(cls, sequence: list[Checkpoint], replicas: list[ReplicaRecord], settings: dict[str, Any],
            engine_args: list[str], driver: dict[str, Any]) -> RolloutState:
        now, rid = time.time(), uuid.uuid4().hex[:12]
        return cls(id=rid, host=socket.gethostname(), sequence=sequence, replicas=replicas, settings=settings,
                   engine_args=engine_args, driver=driver, created=now, updated=now, fleet_id=rid)

    def checkpoint(self, key: str | None) -> Checkpoint | None:
        return next((c for c in self.sequence if c.key == key), None)

    def label(self, key: str | None) -> str:
        """``A``, ``B``, ``C``... by place in the sequence; ``nothing`` for None."""
        if key is None:
            return "nothing"
        for i, c in enumerate(self.sequence):
            if c.key == key:
                return label_of(i)
        return key[:12]

    def daemon(self, key: str) -> DaemonRecord | None:
        """The live recorded daemon holding the checkpoint ``key`` (its identity)."""
        return next((d for d in self.daemons if d.key == key and not d.released), None)

    def unknown(self) -> list[ReplicaRecord]:
        """Replicas whose weights the file cannot name (mid-switch when the rollout stopped)."""
        return [r for r in self.replicas if r.phase in ("switching", "rolling_back")]

    def mark(self, replica: ReplicaRecord, phase: str, serving: str | None, target: str | None = None,
             note: str = "") -> None:
        """Record a replica's new phase and what it serves, with a timeline entry."""
        if phase not in PHASES:
            raise StateError(f"unknown replica phase {phase!r}")
        replica.phase, replica.serving, replica.target = phase, serving, target
        self.timeline.append({"t": round(time.time(), 3), "replica": replica.index, "phase": phase,
                              "serving": serving, "target": target, "note": note})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, source: str) -> RolloutState:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise StateError(f"{source}: not a rollout state file (format {found!r}, expected {FORMAT!r})")
        state = convert(obj, cls, source, StateError)
        for r in state.replicas:
            if r.phase not in PHASES:
                raise StateError(f"{source}: replica {r.index} has unknown phase {r.phase!r}")
        if state.status not in STATUSES:
            raise StateError(f"{source}: unknown status {state.status!r}")
        if len(state.sequence) < 2 or not 1 <= state.step < len(state.sequence):
            raise StateError(f"{source}: step {state.step} is outside the sequence of {len(state.sequence)}")
        if len(state.unknown()) > 1:
            # Written one replica at a time; two mid-switch means someone else wrote it.
            raise StateError(f"{source}: replicas {[r.index for r in state.unknown()]} are all mid-switch; "
                             "this file was not written by a rollout")
        return state


def save_state(path: Path, state: RolloutState) -> None:
    """Write the state file atomically, 0600 (it names pids and paths)."""
    state.updated = time.time()
    atomic.write_json(path, state.to_json(), mode=0o600)


def load_state(path: Path) -> RolloutState | None:
    """The state file at ``path``, or None when there is none."""
    import json

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read the rollout state {path}: {exc.strerror or exc}") from exc
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise StateError(f"{path}: not JSON ({exc}); it was not written by a rollout") from exc
    return RolloutState.from_json(obj, str(path))


class HostLock:
    """One rollout per host: ``flock`` on a lock file, holder recorded in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> HostLock:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = open_lock_file(self.path, "rollout lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, since, _ = read_holder(fd)
            os.close(fd)
            when = time.strftime("%H:%M:%S", time.localtime(since)) if since else "an unknown time"
            raise RolloutLockedError(
                f"another rollout runs on this host (pid {pid}, since {when}; lock {self.path}); "
                "one rollout per host at a time: wait for it to finish, then run again") from None
        record_holder(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> HostLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
