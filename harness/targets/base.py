"""The interface every gate target implements: one weight cache, judged the same way.

A target is a weight cache people run. The gate asks it three things, and
nothing else, so a new cache is one new module:

- ``prepare``: build the cache from the base, as an operator would (start a
  daemon, run a first ``npcache`` load, save a sharded state), under the
  settings the case says the cache was prepared with;
- ``cached_spec``: the engine that serves the candidate through that cache;
- ``served``: what can be proven about what that engine served. A cache
  that records a load event (ours, our daemon under the header-only key,
  vLLM's ``ipc_cache`` through its log lines) gives events the verdict
  checks against an independent hash; one that records nothing gets
  ``hit_proven=False`` and is judged on its output alone: it can PASS only
  when its tokens and logprobs equal ``auto``'s, and the report says the hit
  could not be proven.

The runner (:mod:`harness.targets.runner`) does the rest the same way for
every target: candidates from the mutation table, ``auto`` references,
engines in subprocesses, verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase

# The env switch that lets the daemon's and loader's negative-control options
# run at all; the gate sets it for its own child processes only.
UNSAFE_CONTROLS_ENV = "PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS"


@dataclass
class PreparedCache:
    """A cache built from the base: where it lives and what it was built from."""

    settings: EngineSettings
    location: Path
    source_digest: str  # independent content digest of what the cache was built from
    info: dict[str, Any] = field(default_factory=dict)
    handle: Any = None  # a running daemon, if the cache is one


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

    def unavailable(self) -> str | None:
        """Why this platform cannot run the target at all (None: it can)."""
        return None

    def case_unavailable(self, case: GateCase) -> str | None:
        """Why one case cannot run here (None: it can)."""
        return None

    def child_env(self) -> dict[str, str]:
        """Environment for the target's own child processes (daemons, engines)."""
        return {}

    def prepare(self, base: Path, settings: EngineSettings, workdir: Path,
                engine_timeout_s: float) -> PreparedCache:
        """Build the cache from ``base`` under ``workdir``. Every target the
        target runner drives defines it; those on the gate's daemon path
        (verified_cache, header_only) never reach it."""
        raise NotImplementedError(f"{type(self).__name__} is not run by the target runner")

    def place(self, cache: PreparedCache, candidate: Path) -> None:
        """Put the cache where the engine on ``candidate`` finds it, when it
        lives in the checkpoint directory and the candidate does not carry it."""

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any]) -> EngineSpec:
        """The cached engine's spec for ``case`` (as :meth:`prepare`: runner targets only)."""
        raise NotImplementedError(f"{type(self).__name__} is not run by the target runner")

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        """What can be proven about what the engine served; ``log`` is its whole log
        (as :meth:`prepare`: runner targets only)."""
        raise NotImplementedError(f"{type(self).__name__} is not run by the target runner")

    def close(self, cache: PreparedCache) -> None:
        """Stop whatever ``prepare`` started."""
