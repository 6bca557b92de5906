"""What one gate run found: each case's inputs, engine results and verdict,
and the overall verdict with its exit code.

Exit codes: 0 every case that ran passed (cases the platform cannot run are
listed as not run, never as passed), 1 some case BLOCKed, 2 the gate could
not run (no case ran end to end, or the daemon did not start).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import GateCase
from harness.verdict import BLOCK, NOT_RUN, PASS, Verdict

EXIT_PASS, EXIT_BLOCKED, EXIT_NOT_RUN = 0, 1, 2


@dataclass
class CaseResult:
    """One case's inputs, both engines' results, and the verdict."""

    name: str
    description: str
    expect: str
    weights_equal: bool
    settings: dict[str, Any]
    status: str
    candidate: str = ""
    candidate_digest: str = ""
    daemon_digest: str = ""
    verdict: Verdict | None = None
    not_run_reason: str = ""
    notes: list[str] = field(default_factory=list)
    key_check: dict[str, Any] | None = None
    fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference: EngineResult | None = None
    cached: EngineResult | None = None
    reference_reused: bool = False
    # Where each engine ran: {"cached": {"node", "attempts"}, "reference": {...}}.
    placement: dict[str, Any] = field(default_factory=dict)

    def record(self, verdict: Verdict) -> None:
        """Take ``verdict``: its status, and for a NOT_RUN verdict (an
        unusable reference) its details as the reason it was not run."""
        self.verdict = verdict
        self.status = verdict.status
        self.not_run_reason = "; ".join(verdict.details) if verdict.status == NOT_RUN else ""

    def to_json(self) -> dict[str, Any]:
        def engine(r: EngineResult | None) -> dict[str, Any] | None:
            return None if r is None else r.to_json()

        return {
            "name": self.name,
            "description": self.description,
            "expect": self.expect,
            "weights_equal": self.weights_equal,
            "settings": self.settings,
            "status": self.status,
            "candidate": self.candidate,
            "candidate_digest": self.candidate_digest,
            "daemon_digest": self.daemon_digest,
            "verdict": None if self.verdict is None else self.verdict.to_json(),
            "not_run_reason": self.not_run_reason,
            "notes": list(self.notes),
            "key_check": self.key_check,
            "fingerprints": self.fingerprints,
            "reference": engine(self.reference),
            "cached": engine(self.cached),
            "reference_reused": self.reference_reused,
            "placement": self.placement,
        }


@dataclass
class PreparedCase:
    """A case on its way to its :class:`CaseResult`: the candidate and the two
    engines that serve it (``auto``, the reference, and the cache's)."""

    case: GateCase
    result: CaseResult
    candidate: Path | None = None
    reference_spec: EngineSpec | None = None
    cached_spec: EngineSpec | None = None


@dataclass
class GateReport:
    """The whole run: what was asked, each case, the overall verdict."""

    mode: str  # "self-test" or "promotion"
    target: str
    candidate: str
    base: str
    cases: list[CaseResult]
    controls: dict[str, Any]
    tolerance: float
    vllm_version: str | None
    seconds: float = 0.0
    error: str | None = None
    daemon: dict[str, Any] = field(default_factory=dict)
    golden: dict[str, Any] = field(default_factory=dict)
    executor: dict[str, Any] = field(default_factory=dict)  # local, or the Ray cluster and its nodes
    # Where each checkpoint's digest came from (manifest, promoted, hashed) and
    # the bytes this run read to hash.
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        c = {PASS: 0, BLOCK: 0, NOT_RUN: 0}
        for r in self.cases:
            c[r.status] += 1
        return c

    @property
    def verdict(self) -> str:
        c = self.counts
        if c[BLOCK]:
            return BLOCK
        if self.error or c[PASS] == 0:
            return NOT_RUN
        return PASS

    @property
    def exit_code(self) -> int:
        return {PASS: EXIT_PASS, BLOCK: EXIT_BLOCKED, NOT_RUN: EXIT_NOT_RUN}[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "tool": "preload-gate",
            "mode": self.mode,
            "target": self.target,
            "candidate": self.candidate,
            "base": self.base,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "counts": self.counts,
            "controls": self.controls,
            "logprob_tolerance": self.tolerance,
            "vllm_version": self.vllm_version,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "daemon": self.daemon,
            "golden": self.golden,
            "executor": self.executor,
            "identity": self.identity,
            "cases": [strict_floats(c.to_json()) for c in self.cases],
        }


def strict_floats(obj: Any) -> Any:
    """``obj`` with each NaN or infinite float as the string Python's json
    module would write for it (``"NaN"``, ``"Infinity"``, ``"-Infinity"``):
    an unusable engine's logprobs then stay in report.json as strict JSON,
    which jq, browsers and CI readers accept (they refuse bare ``NaN``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return json.dumps(obj)
    if isinstance(obj, dict):
        return {k: strict_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_floats(v) for v in obj]
    return obj
