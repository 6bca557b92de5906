"""The one scheduler of a gate run's engines, and where they run (an executor).

Every target's engines go through :func:`run_jobs`: each distinct cached
engine once, each distinct ``auto`` reference once (from the reference
cache where it is stored; computed under its lock otherwise, so two runs
sharing the cache compute it once), cached engines first. *Where* an engine
runs is the executor's: :class:`LocalExecutor` runs it on this machine,
``slots`` at a time, each single-rank engine bound to a core of its own
(today's gate); :class:`harness.gate.ray_executor.RayExecutor` runs it as a
Ray task on a node of a cluster. An executor also prepares the target's
caches (:meth:`Executor.prepare`: a daemon per node that will run its cached
engines), so placement follows the cache.

A job offers its placements in order (``choices``: the node of a cache and
the spec that reads it there; ``None`` as node: anywhere). An executor that
loses a node or cannot place a job on one tries the next, up to
``max_attempts``; when none is left the result is a failed
:class:`harness.engine.EngineResult` whose ``not_run`` says why, and the
case it belongs to is NOT_RUN with that reason, never judged.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.engine import CorePool, EngineResult, EngineSpec, run_engine
from harness.gate.references import ReferenceCache
from harness.mutations import EngineSettings
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache
from harness.targets.digests import seen_digest

Note = Callable[[str, str], None]
# A terminal's colour and cursor sequences (CSI ... final byte), as Ray prints its task errors.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")


def plain_error(exc: BaseException, limit: int = 300) -> str:
    """One line a report can hold for an error raised where an engine or a
    cache ran: ``Type: message``, terminal escapes removed. An error raised
    on a Ray node arrives wrapped (``RayTaskError``, whose first line is a
    coloured ``ray::Task()`` header): its cause, the node's own exception,
    is what it says.

    >>> plain_error(RuntimeError("\x1b[36mray::f()\x1b[39m boom"))
    'RuntimeError: ray::f() boom'
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    lines = [ln.strip() for ln in _ESCAPES.sub("", str(exc)).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


@dataclass
class Placement:
    """One place a job may run: a node (None: anywhere) and the spec it runs there."""

    node: str | None
    spec: EngineSpec


@dataclass
class EngineJob:
    """One engine run: a cached engine (``kind="cached"``) or a reference."""

    kind: str  # "cached" | "reference"
    key: str  # deduplication key within the run
    label: str  # the (first) case it serves, for logs
    choices: list[Placement]
    worker: str
    workdir: Path
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)  # the target's child env
    ref_keys: tuple[str, ...] = ()  # a reference: stored under these keys
    after: list[str] = field(default_factory=list)  # a reference: the cached jobs of its cases

    @property
    def spec(self) -> EngineSpec:
        return self.choices[0].spec


@dataclass
class Outcome:
    """What the executor says of one job: the result, where it ran, its attempts."""

    result: EngineResult
    node: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    not_run: str = ""  # non-empty: the engine never ran to an answer anywhere (reason)
    reused: bool = False  # a reference another run stored meanwhile


class Executor(Protocol):
    """Where engines and caches run (see the module docstring)."""

    slots: int
    name: str
    # True: a reference starts only once one of its cases' cached engines ran
    # (an executor whose placements can fail: no engine for a case never judged).
    waits_for_cached: bool

    def prepare(self, target: CacheTarget, base: Path, settings: EngineSettings,
                ctx: PrepareContext) -> list[PreparedCache]:
        """The cache built from ``base``: one per node that will run its cached
        engines (one for a cache every node reads). Raises PreloadGateError."""

    def run(self, job: EngineJob) -> Outcome:
        """Run ``job`` at one of its placements; never raises for engine failures."""

    def close(self, target: CacheTarget, caches: Sequence[PreparedCache]) -> None:
        """Stop what :meth:`prepare` started."""

    def describe(self) -> dict[str, Any]:
        """The executor in the report: its kind and where it ran."""


def run_seen(spec: EngineSpec, workdir: Path | str, timeout_s: float, worker: str) -> EngineResult:
    """Run one engine where this process runs, and say which content it was
    given: the digest of ``spec.checkpoint`` as this machine sees it
    (:func:`harness.targets.digests.seen_digest`), taken before the engine
    opens it. The runner compares it with the promoted candidate's digest;
    a machine that sees other files at the path never passes."""
    seen = seen_digest(spec.checkpoint)
    result = run_engine(spec, workdir, timeout_s=timeout_s, worker=worker)
    result.weights_digest = seen
    return result


class LocalExecutor:
    """This machine: ``jobs`` engines at once, each single-rank engine bound to
    its own core when more than one runs (:class:`harness.engine.CorePool`)."""

    name = "local"
    waits_for_cached = False

    def __init__(self, jobs: int = 1, cores: Sequence[int] | None = None) -> None:
        self.slots = max(1, jobs)
        self._cores = CorePool(jobs, cores)

    def prepare(self, target: CacheTarget, base: Path, settings: EngineSettings,
                ctx: PrepareContext) -> list[PreparedCache]:
        return [target.prepare(base, settings, ctx)]

    def run(self, job: EngineJob) -> Outcome:
        with self._cores.pinned(job.spec, job.env) as spec:
            result = run_seen(spec, job.workdir, job.timeout_s, job.worker)
        return Outcome(result, attempts=[{"node": None, "ok": result.ok, "seconds": result.timings.get("wall")}])

    def close(self, target: CacheTarget, caches: Sequence[PreparedCache]) -> None:
        for cache in caches:
            target.close(cache)

    def describe(self) -> dict[str, Any]:
        return {"kind": "local", "slots": self.slots}


def run_jobs(jobs: Sequence[EngineJob], executor: Executor, refs: ReferenceCache,
             note: Note) -> dict[tuple[str, str], Outcome]:
    """Run every job through ``executor`` (``executor.slots`` at a time), cached
    engines first: their results do not depend on the references, and a
    reference another run computes meanwhile (the demo's other lane) is then
    most likely stored by the time this run asks for it. References go
    through ``refs`` (stored ones reused; a key another run holds is waited
    for, holding no slot)."""
    ordered = [j for j in jobs if j.kind == "cached"] + [j for j in jobs if j.kind != "cached"]
    done: dict[tuple[str, str], Outcome] = {}
    total = len(ordered)
    finished = {j.key: threading.Event() for j in ordered if j.kind == "cached"}

    def one(job: EngineJob) -> None:
        def run() -> Outcome:
            note("engine-start", f"{job.kind} {job.label}")
            t0 = time.monotonic()
            out = executor.run(job)
            where = f" on node {out.node[:12]}" if out.node else ""
            state = "ok" if out.result.ok else ("not run" if out.not_run else "failed")
            note("engine-done", f"{job.kind} {job.label}{where} ({len(done) + 1}/{total}, {state}, "
                 f"{time.monotonic() - t0:.0f} s)")
            return out

        if job.kind == "cached":
            try:
                done[(job.kind, job.key)] = run()
            finally:
                finished[job.key].set()
            return
        if executor.waits_for_cached and job.after:
            for key in job.after:
                finished[key].wait()
            if all(done[("cached", k)].not_run for k in job.after):
                done[(job.kind, job.key)] = Outcome(EngineResult(ok=False, error="not started"),
                                                    not_run="not started: its cases' cached engines were not run")
                return
        box: list[Outcome] = []

        def compute() -> EngineResult:
            box.append(run())
            return box[0].result

        result, reused = refs.reference(list(job.ref_keys), compute, what=job.spec.checkpoint)
        out = box[0] if box else Outcome(result, reused=True)
        out.reused = reused
        if reused:
            note("engine-done", f"reference {job.label} ({len(done) + 1}/{total}, "
                 "reused: another run stored it meanwhile)")
        done[(job.kind, job.key)] = out

    with ThreadPoolExecutor(max_workers=max(1, min(executor.slots, len(ordered) or 1))) as pool:
        list(pool.map(one, ordered))
    return done
