"""One gate case prepared without a daemon or engines: the cache a verified_cache
daemon would be, named by its digest and socket root (shared by the gate unit tests)."""

from __future__ import annotations

from pathlib import Path

from harness.gate import GateOptions, plan_for
from harness.gate.runner import RunPlan, prepare_case
from harness.mutations import BASE_SETTINGS, GateCase
from harness.targets.base import PreparedCache


def prepare(opts: GateOptions, case: GateCase, digest: str, workdir: Path, socket_root: str):
    """``(plan, prepared case)`` for ``case`` against a cache holding ``digest``."""
    plan: RunPlan = plan_for(opts, workdir, socket_root)
    controls = plan.target.controls(plan.ctx) if hasattr(plan.target, "controls") else {}
    cache = PreparedCache(BASE_SETTINGS, Path(socket_root), digest, info={"controls": controls})
    return plan, prepare_case(plan, case, cache)
