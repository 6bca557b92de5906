"""A replica as a rollout sees it: what it is restarted onto, when it serves, what it loaded.

Drivers (:class:`ReplicaDriver`) only stop and start replicas; everything
a rollout believes about a replica comes from the replica itself, the same
way for every driver:

- readiness: ``GET /health`` answers 200 and ``GET /v1/models`` lists a
  model (vLLM's OpenAI server answers /health before the model is served
  on some versions; /v1/models only once it is);
- what it loaded: the load events its ``verified_cache`` loader appended to
  its events file since the restart began (one per rank; a hit must name
  the key asked for as the daemon's digest), so a replica that did not
  restart at all (a restart command that did nothing) shows no new event;
- what it answers: the canary (:mod:`harness.rollout.switch`).

Every replica is started with ``fallback: false``: a replica that cannot
get the daemon's weights fails to start, naming the reason, instead of
reading from disk behind the rollout's back.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from harness.rollout.state import ReplicaRecord
from pgbase.errors import PreloadGateError

LOAD_FORMAT = "verified_cache"
POLL_S = 0.5
EVENTLESS_GRACE_S = 5.0


class StartFailedError(PreloadGateError):
    """A replica did not come up serving what it was restarted onto.

    ``reason``: ``start_failed`` (the process exited), ``miss`` (its load
    recorded a miss or an error), ``not_ready`` (no answer before the
    deadline), ``no_load_event`` (it serves, but recorded no load since the
    restart), ``wrong_load_event`` (a hit on another digest),
    ``restart_command_failed`` (the driver's command exited non-zero).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Target:
    """What a replica is restarted onto.

    ``key`` is the digest the loader asks the daemon for (the content
    digest; vLLM's header hash under the ``header_only`` negative control).
    ``load_format`` ``auto`` (disk, no daemon) exists for the bench's anchor.
    """

    checkpoint: str
    key: str
    label: str
    socket_root: str
    unsafe_identity: str | None = None
    load_format: str = LOAD_FORMAT
    # On only where the checkpoint is not resident (--evict-first rolled its
    # daemon away): the loader then misses loudly and reads the disk.
    fallback: bool = False
    # The checkpoint as the rollout's state names it (its identity; "": ``key``).
    handle: str = ""

    def loader_config(self, events_file: str) -> dict[str, Any]:
        cfg: dict[str, Any] = {"socket_root": self.socket_root, "fallback": self.fallback, "identity": "pinned",
                               "expected_digest": self.key, "events_file": events_file}
        if self.unsafe_identity:
            cfg["unsafe_identity"] = self.unsafe_identity
        return cfg

    def serve_args(self, engine_args: list[str], events_file: str) -> list[str]:
        """The arguments after the serve command's model: engine args, then the loader's."""
        if self.load_format != LOAD_FORMAT:
            return [*engine_args, "--load-format", self.load_format]
        return [*engine_args, "--load-format", LOAD_FORMAT,
                "--model-loader-extra-config", json.dumps(self.loader_config(events_file))]


class ReplicaDriver(Protocol):
    """How replicas are stopped and started; the rollout judges the result itself."""

    kind: str

    def describe(self) -> dict[str, Any]:
        """The driver's settings, recorded in the state file."""

    def restart(self, record: ReplicaRecord, target: Target, saved: Callable[[], None]) -> None:
        """Stop whatever serves as this replica and start it onto ``target``;
        call ``saved()`` after changing ``record`` (a new pid) so the state
        file names the new process before anything is waited for. Raises
        :class:`StartFailedError` when the restart itself fails."""

    def alive(self, record: ReplicaRecord) -> bool | None:
        """Whether the replica's process runs (None: this driver cannot see it)."""

    def log_tail(self, record: ReplicaRecord) -> str:
        """The end of the replica's log, for a start-up failure ("" when none)."""

    def stop(self, record: ReplicaRecord) -> None:
        """Stop the replica for good (``rollout --stop``; a driver that cannot does nothing)."""


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (the operator's replica)
            return int(r.status), r.read(1 << 20)
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""


def probe(url: str, timeout_s: float = 2.0) -> list[dict[str, Any]] | None:
    """The models a replica serves when ``/health`` is 200 and ``/v1/models``
    lists at least one; None when it does not serve (yet)."""
    root = url.rstrip("/").removesuffix("/v1")
    try:
        code, _ = _get(root + "/health", timeout_s)
        if code != 200:
            return None
        code, body = _get(root + "/v1/models", timeout_s)
    except (OSError, ValueError):
        return None
    if code != 200:
        return None
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return None
    return data if isinstance(data, list) and data else None


def read_new_events(record: ReplicaRecord, seen: int) -> list[dict[str, Any]]:
    """The load events appended to the replica's events file after the first ``seen``."""
    from preload.events import read_events

    return read_events(record.events_file)[seen:]


def count_events(record: ReplicaRecord) -> int:
    from preload.events import read_events

    return len(read_events(record.events_file))


def judge_events(events: list[dict[str, Any]], target: Target) -> None:
    """Raise :class:`StartFailedError` unless every new event is a hit on ``target.key``."""
    if target.load_format != LOAD_FORMAT:
        return  # an auto replica records no load event
    if not events:
        raise StartFailedError("no_load_event", "it serves, but recorded no load event since the restart "
                                                "(did it restart? is it started with this loader config?)")
    for e in events:
        if target.fallback and e.get("outcome") == "miss" and e.get("source") == "disk" and e.get("digest") == target.key:
            continue  # not resident by the operator's choice: a loud miss, then the disk
        if e.get("outcome") != "hit":
            raise StartFailedError("miss", f"rank {e.get('rank', 0)} load ended in {e.get('outcome')}: "
                                           f"{e.get('reason') or 'no reason given'}")
        if e.get("daemon_digest") != target.key:
            raise StartFailedError("wrong_load_event", f"rank {e.get('rank', 0)} hit on "
                                   f"{str(e.get('daemon_digest'))[:16]}, not {target.key[:16]}")


def wait_serving(driver: ReplicaDriver, record: ReplicaRecord, target: Target, seen: int,
                 timeout_s: float) -> list[dict[str, Any]]:
    """Wait until the replica serves with a load recorded since ``seen``;
    returns its new load events. A process that exits, a recorded miss and a
    deadline are each a :class:`StartFailedError` naming the reason."""
    deadline = time.monotonic() + timeout_s
    need_event = target.load_format == LOAD_FORMAT
    eventless_since: float | None = None
    while True:
        events = read_new_events(record, seen)
        bad = [e for e in events if e.get("outcome") not in ("hit", "miss" if target.fallback else "hit")]
        if bad and need_event:
            judge_events(events, target)  # raises: the miss, named (fallback is off: it will not serve)
        alive = driver.alive(record)
        if alive is False:
            tail = driver.log_tail(record)[-1200:]
            raise StartFailedError("start_failed", "the replica exited before it served" + (f"; log:\n{tail}" if tail else ""))
        serves = probe(record.url) is not None
        if serves and (events or not need_event):
            judge_events(events, target)
            return events
        now = time.monotonic()
        # A loader writes its event before the server answers: serving without
        # one for a while is a replica that did not load through us (or an old
        # process a restart command left answering).
        eventless_since = (eventless_since or now) if serves else None
        if eventless_since is not None and (now - eventless_since >= EVENTLESS_GRACE_S or now >= deadline):
            judge_events(events, target)  # raises no_load_event
        if now >= deadline:
            if events:
                raise StartFailedError("not_ready", f"it loaded but did not serve within {timeout_s:g} s")
            raise StartFailedError("not_ready", f"no load event and no answer on /health and /v1/models within "
                                                f"{timeout_s:g} s")
        time.sleep(POLL_S)
