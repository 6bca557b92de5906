"""One replica onto one checkpoint, judged: restart, serve, load event, canary.

A switch passes only when all four hold, in this order:

1. the driver restarted the replica (:class:`harness.rollout.replicas.StartFailedError`
   ``restart_command_failed`` / ``start_failed`` otherwise);
2. it serves (``/health``, ``/v1/models``) before ``ready_timeout_s``
   (``not_ready``), without exiting (``start_failed``);
3. every load event it recorded since the restart is a hit on the key
   asked for (``miss``, ``no_load_event``, ``wrong_load_event``);
4. the canary (:func:`canaries.check.check`) against the checkpoint's
   golden: tokens exactly, logprobs within the tolerance (``canary_failed``,
   the canary's own reason in the detail); near-ties pass the canary, but
   more than ``max_near_ties`` of them in one answer set that the golden
   did not itself record as ties (two tokens within one step of its own
   arithmetic, :func:`canaries.compare.recording_grain`) is
   ``near_tie_flood`` (a few swaps are numeric noise; many are a replica
   that answers differently). A swap the golden recorded as a tie is what
   the golden foresaw and is not counted.

The seconds of each phase are kept: ``switch`` is stop to canary pass, the
bench's figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from canaries.golden import Golden
from harness.rollout.replicas import (
    ReplicaDriver,
    StartFailedError,
    Target,
    count_events,
    wait_serving,
)
from harness.rollout.state import ReplicaRecord

REASONS = ("restart_command_failed", "start_failed", "not_ready", "miss", "no_load_event", "wrong_load_event",
           "canary_failed", "near_tie_flood")
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_CANARY_TIMEOUT_S = 60.0
DEFAULT_MAX_NEAR_TIES = 2


@dataclass(frozen=True)
class SwitchOptions:
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    canary_timeout_s: float = DEFAULT_CANARY_TIMEOUT_S
    canary_retries: int = 1
    max_near_ties: int = DEFAULT_MAX_NEAR_TIES
    tolerance: float | None = None


@dataclass
class SwitchResult:
    """How one switch went; ``reason`` is one of :data:`REASONS` when it failed."""

    replica: int
    onto: str
    key: str
    ok: bool
    reason: str = ""
    detail: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    canary: dict[str, Any] | None = None
    rollback: bool = False
    started_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def canary(url: str, golden: Golden, opts: SwitchOptions) -> tuple[bool, str, str, dict[str, Any]]:
    """``(ok, reason, detail, result)`` of the canary on one replica."""
    from canaries.check import check
    from canaries.compare import DEFAULT_TOLERANCE

    tolerance = DEFAULT_TOLERANCE if opts.tolerance is None else opts.tolerance
    report = check([url], golden, timeout=opts.canary_timeout_s, retries=opts.canary_retries, tolerance=tolerance)
    (r,) = report.results
    result = {**asdict(r), "verdict": r.verdict}
    result.pop("first_difference", None)
    result["first_difference"] = _plain(r.first_difference)
    if not r.ok:
        return False, "canary_failed", f"canary {r.reason}: {r.detail}", result
    # The budget judges the swaps the golden did not record as ties (canaries.compare.recording_grain).
    unforeseen = [t for t in r.near_ties if not t.get("recorded")]
    if len(unforeseen) > opts.max_near_ties:
        foreseen = len(r.near_ties) - len(unforeseen)
        return False, "near_tie_flood", (f"{len(unforeseen)} near-ties in one answer set that the golden did not "
                                         f"record as ties (more than --max-near-ties {opts.max_near_ties}"
                                         + (f"; {foreseen} more it recorded" if foreseen else "") + f"): {r.detail}"), \
            result
    return True, "", r.detail, result


def _plain(obj: Any) -> Any:
    """A canary difference as JSON (its ``difference`` may still be a dataclass)."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return obj


def switch(driver: ReplicaDriver, record: ReplicaRecord, target: Target, golden: Golden | None,
           opts: SwitchOptions, saved: Callable[[], None], adopt: bool = False) -> SwitchResult:
    """Move ``record``'s replica onto ``target`` and judge it (never raises for the replica's faults).

    ``adopt``: the replica's recorded process was already started onto
    ``target`` by a run that died meanwhile; wait for it instead of
    restarting it (``record.events_seen`` holds the count before its start).
    """
    res = SwitchResult(record.index, target.label, target.handle or target.key, ok=False, started_at=time.time())
    t0 = time.monotonic()
    try:
        if not adopt:
            record.events_seen = count_events(record)
            record.started_onto = None
            saved()
            driver.restart(record, target, saved)
            record.started_onto = target.handle or target.key
            saved()
        res.seconds["restart"] = round(time.monotonic() - t0, 3)
        t1 = time.monotonic()
        res.events = wait_serving(driver, record, target, record.events_seen, opts.ready_timeout_s)
        res.seconds["ready"] = round(time.monotonic() - t1, 3)
    except StartFailedError as exc:
        res.reason, res.detail = exc.reason, exc.detail
        res.seconds["total"] = round(time.monotonic() - t0, 3)
        return res
    if golden is None:
        res.ok, res.detail = True, "no golden for this checkpoint: judged by its load event only"
    else:
        t2 = time.monotonic()
        res.ok, res.reason, res.detail, res.canary = canary(record.url, golden, opts)
        res.seconds["canary"] = round(time.monotonic() - t2, 3)
    res.seconds["switch"] = res.seconds["total"] = round(time.monotonic() - t0, 3)
    return res
