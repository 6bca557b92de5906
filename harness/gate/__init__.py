"""The gate: cached engine vs ``auto`` on every case, verdicts, one exit code.

Two uses, one code path:

- self-test (``mutations`` given): the base is mutated into one candidate per
  case; one daemon holds the BASE for all of them; each candidate is served
  by a cached engine (it must hit where the weights and settings equal the
  base's, and miss loudly everywhere else) and by an ``auto`` engine.
- promotion (no ``mutations``): the candidate itself is promoted and
  preloaded, a cached engine on it must hit and match ``auto``, and the
  golden canary file is recorded for the deploy.

``auto`` references are cached on disk by (candidate digest, engine
settings, vLLM version): the same bytes under the same settings give the
same reference, so a rerun only starts cached engines.

Exit codes: 0 every case that ran passed (cases the platform cannot run are
listed as not run, never as passed), 1 some case BLOCKed, 2 the gate could
not run (no case ran end to end, or the daemon did not start).

>>> report = run_gate(GateOptions(candidate="/models/tiny", mutations="all"))  # doctest: +SKIP
>>> report.exit_code  # doctest: +SKIP
0
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from harness.gate.cases import (
    MAX_MODEL_LEN,
    gate_settings,
    promotion_case,
    select_target_cases,
    settings_json,
    switch_case,
)
from harness.gate.golden import record_golden
from harness.gate.options import GateOptions, GateSetupError
from harness.gate.references import ReferenceCache, vllm_version
from harness.gate.runner import RunPlan, run_cases
from harness.gate.schedule import Executor, LocalExecutor
from harness.mutations import BASE_SETTINGS
from harness.results import CaseResult, GateReport
from harness.targets import NAMES, get_target
from harness.targets.base import UNSAFE_CONTROLS_ENV, PrepareContext
from harness.targets.checkpoints import weight_files
from harness.targets.digests import Digests
from harness.verdict import PASS
from preload.deployment import DeploymentSettings
from preload.identity.digest import content_digest
from preload.preflight import check_dtype, check_engine_choices, check_output_dirs

TARGETS = NAMES

# What callers import from here: the options, the entry point, and what the
# tests and the bench share with it.
__all__ = ["TARGETS", "CaseResult", "GateOptions", "GateReport", "GateSetupError", "ReferenceCache",
           "content_digest", "plan_for", "run_gate", "select_target_cases", "settings_json", "switch_case", "vllm_version"]


def run_gate(opts: GateOptions, executor: Executor | None = None) -> GateReport:
    """Run the gate and return its report (write it with ``harness.report``).

    ``executor``: where engines run (default: this machine, ``opts.jobs`` at
    a time; :class:`harness.gate.ray_executor.RayExecutor` for a Ray cluster).
    """
    t0 = time.monotonic()
    if opts.target not in TARGETS:
        raise GateSetupError(f"unknown target {opts.target!r}; choose one of {', '.join(TARGETS)}")
    target = get_target(opts.target)
    candidate = Path(opts.candidate)
    weight_files(candidate)  # a missing or empty checkpoint is one clear line, before anything runs
    self_test = opts.mutations is not None
    base = Path(opts.base) if (opts.base and self_test) else candidate
    if opts.base:
        weight_files(opts.base)
    cases = select_target_cases(target, opts.mutations or "all") if self_test else [promotion_case(opts)]
    if not self_test and opts.base:  # a daemon still holding the base: the candidate must miss loudly
        cases.append(switch_case(opts))
    if not self_test:  # the deployment settings vLLM would refuse, before any daemon or engine
        settings = gate_settings(opts).to_json()
        check_dtype(str(settings.get("dtype") or "auto"))
        check_engine_choices(settings)
    # Every directory the run writes is known now, not after the engines ran;
    # checked after the read-only checks above (the probe changes a directory's stat).
    check_output_dirs({"--report": opts.report_dir, "--workdir": opts.workdir,
                       "--reference-cache": opts.reference_cache})
    unsafe_identity = opts.unsafe_identity or target.unsafe_identity
    report = GateReport(
        mode="self-test" if self_test else "promotion",
        target=opts.target,
        candidate=str(candidate),
        base=str(opts.base or base),
        cases=[],
        controls={"unsafe_identity": unsafe_identity,
                  "unsafe_silent_fallback": opts.unsafe_silent_fallback, "run_tp": opts.run_tp},
        tolerance=opts.tolerance,
        vllm_version=vllm_version(),
    )
    executor = executor or LocalExecutor(opts.jobs, opts.cores)
    # A cluster is connected here (a Ray head that does not answer is one
    # line), before any directory is made or anything starts.
    report.executor = executor.describe()
    own_workdir = opts.workdir is None
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix=f"preload-gate-{target.name}-"))
    socket_root = opts.socket_root or tempfile.mkdtemp(prefix="pg-sock-")
    os.chmod(socket_root, 0o700)
    plan = plan_for(opts, workdir, socket_root, executor)
    digests = plan.digests
    try:
        run_cases(plan, cases, report)
        if not self_test and opts.record_golden and report.verdict == PASS:
            report.golden = record_golden(opts, candidate)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if opts.socket_root is None:
            shutil.rmtree(socket_root, ignore_errors=True)
    report.identity = {"sources": dict(digests.sources), "hashed_bytes": digests.hashed_bytes}
    report.seconds = time.monotonic() - t0
    return report


def plan_for(opts: GateOptions, workdir: Path, socket_root: str, executor: Executor | None = None) -> RunPlan:
    """What the runner needs for ``opts``: the target, where engines run, the
    run's digests and what a target's ``prepare`` is given."""
    target = get_target(opts.target)
    self_test = opts.mutations is not None
    candidate = Path(opts.candidate)
    base = Path(opts.base) if (opts.base and self_test) else candidate
    digests = Digests(socket_root, opts.progress)
    d = gate_settings(opts) if not self_test else DeploymentSettings(dtype=BASE_SETTINGS.dtype)
    daemon_args = [*d.engine_args(), *([] if d.max_model_len else ["--max-model-len", str(MAX_MODEL_LEN)])]
    # A target's progress lines go straight to the caller's callback (none given: the context's silent one).
    note = {"note": opts.progress} if opts.progress else {}
    ctx = PrepareContext(workdir=workdir, socket_root=socket_root, engine_timeout_s=opts.engine_timeout_s,
                         digest_of=digests.of, promote=digests.promoted, daemon_args=tuple(daemon_args),
                         unsafe_identity=opts.unsafe_identity,
                         unsafe_silent_fallback=opts.unsafe_silent_fallback,
                         env=_child_env(opts), **note)
    return RunPlan(target=target, executor=executor or LocalExecutor(opts.jobs, opts.cores), digests=digests,
                   ctx=ctx, base=base, alt_base=Path(opts.base) if opts.base else None, self_test=self_test,
                   run_tp=opts.run_tp, tolerance=opts.tolerance, reference_cache=opts.reference_cache,
                   progress=opts.progress)


def _child_env(opts: GateOptions) -> dict[str, str]:
    """The negative controls run only with the test switch; it is set for the
    gate's own children (daemon, cached engines), never in this process."""
    if opts.unsafe_identity or opts.unsafe_silent_fallback:
        return {UNSAFE_CONTROLS_ENV: "1"}
    return {}
