"""The interface every gate target implements: one weight cache, judged the same way.

A target is a weight cache people run, ours included. The gate's one runner
(:mod:`harness.gate.runner`) asks it these things, and nothing else, so a
new cache is one new module:

- ``prepare``: build the cache from the base, as an operator would (start a
  daemon, run a first ``npcache`` load, save a sharded state), under the
  settings the case says the cache was prepared with;
- ``before_edit`` / ``place``: what an operator does to a candidate the gate
  derived (ours: promote it, before an in-place overwrite or after a copy);
- ``cached_spec``: the engine that serves the candidate through that cache;
- ``served``: what can be proven about what that engine served. A cache
  that records a load event (ours, our daemon under the header-only key,
  vLLM's ``ipc_cache`` through its log lines) gives events the verdict
  checks against an independent hash; one that records nothing gets
  ``hit_proven=False`` and is judged on its output alone: it can PASS only
  when its tokens and logprobs equal ``auto``'s, and the report says the hit
  could not be proven.

The class attributes declare the rest the runner needs to know (which
checkpoint format the cache reads, whether it writes into the base, whether
it lives in a process on one node). The runner does everything else the same
way for every target: candidates from the mutation table, ``auto``
references, engines through the one scheduler, verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase

# The env switch that lets the daemon's and loader's negative-control options
# run at all; the gate sets it for its own child processes only.
UNSAFE_CONTROLS_ENV = "PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS"


@dataclass
class PrepareContext:
    """What a target's :meth:`CacheTarget.prepare` is given besides the base.

    ``digest_of(path)`` is the run's digest of a checkpoint: the promotion's,
    carried with its proof (the manifest and its stat check), hashed only
    where no manifest vouches for the bytes (:class:`harness.targets.digests.Digests`).
    ``daemon_args`` are the deployment's engine arguments a daemon is started
    with (``--dtype ...``); ``env`` is added to every child's environment (the
    negative controls' switch).
    """

    workdir: Path
    socket_root: str
    engine_timeout_s: float
    digest_of: Callable[[Path], str]
    promote: Callable[[Path], str]
    daemon_args: tuple[str, ...] = ()
    unsafe_identity: str | None = None
    unsafe_silent_fallback: bool = False
    env: dict[str, str] = field(default_factory=dict)
    note: Callable[[str, str], None] = lambda _stage, _msg: None


@dataclass
class PreparedCache:
    """A cache built from the base: where it lives and what it was built from.

    ``node`` is the node it lives on when it is a process there (a daemon on
    a Ray node; None: this machine, or a path every node reads)."""

    settings: EngineSettings
    location: Path
    source_digest: str  # independent content digest of what the cache was built from
    info: dict[str, Any] = field(default_factory=dict)
    handle: Any = None  # a running daemon, if the cache is one
    node: str | None = None


@dataclass
class Served:
    """What the gate can prove about what a cached engine served."""

    hit_proven: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"hit_proven": self.hit_proven, "events": self.events, "notes": self.notes}


class CacheTarget:
    """One weight cache. Subclasses set the class attributes and the three methods."""

    name = ""
    summary = ""
    # The cache's loads end in events the verdict can check (hit/miss, digests).
    records_events = False
    # The checkpoint format the cache reads ("safetensors" or "bin").
    checkpoint_format = "safetensors"
    # Cases `--mutations all` runs for this target (rows of harness.mutations).
    default_cases: tuple[str, ...] = ()
    # The identity the cache's daemon and loader are keyed by, when it is not
    # the content digest (header_only: vLLM's key, a negative control the gate
    # runs with the unsafe-controls switch). None: ours.
    unsafe_identity: str | None = None
    # The worker modules its engines run (``python -m WORKER SPEC OUT``); a test
    # points them at stand-ins for vLLM's public boundary.
    engine_worker = "harness.engine_worker"
    reference_worker = "harness.engine_worker"
    # True: prepare gets a private copy of the base in checkpoint_format (the
    # cache may write into it: npcache dumps np/ there) and a promotion serves a
    # copy of the candidate. False: the base and the promoted candidate as given.
    stages_base = True
    # The cache is a process on one node (a daemon): its cached engines run on
    # that node, never elsewhere. False: files the engine reads by path.
    node_local = False
    # The report shows each file row's anchor-scheme fingerprints (base vs candidate).
    reports_fingerprints = False

    def unavailable(self) -> str | None:
        """Why this platform cannot run the target at all (None: it can)."""
        return None

    def case_unavailable(self, case: GateCase) -> str | None:
        """Why one case cannot run here (None: it can)."""
        return None

    def child_env(self) -> dict[str, str]:
        """Environment for the target's own child processes (daemons, engines)."""
        return {}

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        """Build the cache from ``base`` under ``ctx.workdir``; raise
        :class:`harness.targets._procs.PrepareError` (a PreloadGateError) when it
        cannot be built."""
        raise NotImplementedError(f"{type(self).__name__}.prepare")

    def before_edit(self, cache: PreparedCache, staged: Path, ctx: PrepareContext) -> None:
        """An in-place row's private copy of the base, before the recipe overwrites it."""

    def place(self, cache: PreparedCache, candidate: Path, ctx: PrepareContext) -> None:
        """Put the cache where the engine on ``candidate`` finds it: what an
        operator does before serving it (copy a dump beside it, promote it)."""

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        """The cached engine's spec for ``case``; ``expect`` is the outcome the
        digests and keys require (``hit`` or ``miss``)."""
        raise NotImplementedError(f"{type(self).__name__}.cached_spec")

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        """What can be proven about what the engine served; ``log`` is its whole log."""
        raise NotImplementedError(f"{type(self).__name__}.served")

    def close(self, cache: PreparedCache) -> None:
        """Stop whatever ``prepare`` started."""
