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

import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.daemon_process import DaemonProcess, DaemonStartError
from harness.engine import CorePool, EngineResult, EngineSpec, run_engine
from harness.gate.cases import (
    MAX_MODEL_LEN,
    gate_settings,
    promotion_case,
    select_target_cases,
    settings_json,
    switch_case,
)
from harness.gate.fingerprints import all_prints, fingerprint_matrix
from harness.gate.golden import record_golden
from harness.gate.options import GateOptions, GateSetupError
from harness.gate.references import ReferenceCache, vllm_version
from harness.mutations import BASE_SETTINGS, GateCase
from harness.results import CaseResult, GateReport, PreparedCase
from harness.targets import NAMES, get_target
from harness.targets.base import UNSAFE_CONTROLS_ENV
from harness.targets.checkpoints import weight_files
from harness.verdict import NOT_RUN, PASS, Expectation, expected_outcome, judge
from preload.deployment import DeploymentSettings
from preload.identity.digest import content_digest
from preload.preflight import check_dtype, check_engine_choices, check_output_dirs

TARGETS = NAMES

# What callers import from here: the options, the entry point, and the parts
# a target's own runner and the tests share with the daemon path.
__all__ = ["TARGETS", "CaseResult", "GateOptions", "GateReport", "GateSetupError", "ReferenceCache",
           "content_digest", "run_gate", "select_target_cases", "switch_case", "vllm_version"]


@dataclass
class _Prepared(PreparedCase):
    is_moe: bool = False
    mismatched_fields: tuple[str, ...] = ()


def run_gate(opts: GateOptions) -> GateReport:
    """Run the gate and return its report (write it with ``harness.report``)."""
    t0 = time.monotonic()
    if opts.target not in TARGETS:
        raise GateSetupError(f"unknown target {opts.target!r}; choose one of {', '.join(TARGETS)}")
    target = get_target(opts.target)
    forced = getattr(target, "unsafe_identity", None)
    if forced and not opts.unsafe_identity:  # header_only: our daemon under vLLM's key
        opts = dataclasses.replace(opts, unsafe_identity=forced)
    candidate = Path(opts.candidate)
    weight_files(candidate)  # a missing or empty checkpoint is one clear line, before anything runs
    self_test = opts.mutations is not None
    base = Path(opts.base) if (opts.base and self_test) else candidate
    if opts.base:
        weight_files(opts.base)
    cases = select_target_cases(target, opts.mutations or "all") if self_test else [promotion_case(opts)]
    if not self_test and opts.base and getattr(target, "uses_daemon_path", False):
        cases.append(switch_case(opts))
    if not self_test:  # the deployment settings vLLM would refuse, before any daemon or engine
        settings = gate_settings(opts).to_json()
        check_dtype(str(settings.get("dtype") or "auto"))
        check_engine_choices(settings)
    # Every directory the run writes is known now, not after the engines ran;
    # checked after the read-only checks above (the probe changes a directory's stat).
    check_output_dirs({"--report": opts.report_dir, "--workdir": opts.workdir,
                       "--reference-cache": opts.reference_cache})
    report = GateReport(
        mode="self-test" if self_test else "promotion",
        target=opts.target,
        candidate=str(candidate),
        base=str(opts.base or base),
        cases=[],
        controls={"unsafe_identity": opts.unsafe_identity,
                  "unsafe_silent_fallback": opts.unsafe_silent_fallback, "run_tp": opts.run_tp},
        tolerance=opts.tolerance,
        vllm_version=vllm_version(),
    )
    if not getattr(target, "uses_daemon_path", False):
        from harness.targets.runner import run_target

        if not self_test and opts.base:  # the cache is built from the base: a switch must miss
            cases = [switch_case(opts)]
        run_target(target, opts, cases, report, promotion_candidate=None if self_test else candidate)
        report.seconds = time.monotonic() - t0
        return report

    own_workdir = opts.workdir is None
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="preload-gate-"))
    socket_root = opts.socket_root or tempfile.mkdtemp(prefix="pg-sock-")
    os.chmod(socket_root, 0o700)
    try:
        _run(opts, report, cases, base, candidate, workdir, socket_root, self_test)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if opts.socket_root is None:
            shutil.rmtree(socket_root, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


def _child_env(opts: GateOptions) -> dict[str, str]:
    """The negative controls run only with the test switch; it is set for the
    gate's own children (daemon, cached engines), never in this process."""
    if opts.unsafe_identity or opts.unsafe_silent_fallback:
        return {UNSAFE_CONTROLS_ENV: "1"}
    return {}


def _model_is_moe(checkpoint: Path) -> bool | None:
    """vLLM's own answer (``ModelConfig.is_moe``); None when vLLM is absent."""
    try:
        from vllm.config import ModelConfig
    except ImportError:
        return None
    return bool(ModelConfig(model=str(checkpoint)).is_moe)


def _run(opts: GateOptions, report: GateReport, cases: list[GateCase], base: Path, candidate: Path,
         workdir: Path, socket_root: str, self_test: bool) -> None:
    daemon_ckpt = base if self_test else candidate
    for sub in ("stage", "cand", "engines"):  # a reused --workdir starts clean
        shutil.rmtree(workdir / sub, ignore_errors=True)
    opts.note("hash", f"hashing {daemon_ckpt}")
    daemon_digest = content_digest(daemon_ckpt)
    prepared = [_prepare(opts, c, base, candidate, daemon_digest, workdir, socket_root, self_test)
                for c in cases]
    to_run = [p for p in prepared if p.cached_spec is not None]  # prepared to run; NOT_RUN until judged
    if not to_run:
        report.cases = [p.result for p in prepared]
        return

    from preload.promote import promote

    promote(daemon_ckpt, socket_root=socket_root)
    d = gate_settings(opts) if not self_test else DeploymentSettings(dtype=BASE_SETTINGS.dtype)
    args = [*d.engine_args(), *([] if d.max_model_len else ["--max-model-len", str(MAX_MODEL_LEN)])]
    if opts.unsafe_identity:
        args += ["--unsafe-identity", opts.unsafe_identity]
    daemon = DaemonProcess(str(daemon_ckpt), socket_root, workdir / "daemon.log", args, env=_child_env(opts))
    opts.note("daemon", f"starting the daemon on {daemon_ckpt}")
    try:
        daemon.start()
    except DaemonStartError as exc:
        report.error = str(exc)
        for p in to_run:
            p.result.status = NOT_RUN
            p.result.not_run_reason = "the daemon did not start"
        report.cases = [p.result for p in prepared]
        return
    report.daemon = {"checkpoint": str(daemon_ckpt), "digest": daemon.digest,
                     "independent_digest": daemon_digest, "start_seconds": round(daemon.start_seconds, 3)}
    # A switch case needs the base held, not the candidate: a second daemon.
    switch = [p for p in to_run if p.case.holds_base]
    try:
        _run_engines(opts, [p for p in to_run if p not in switch], socket_root, workdir)
    finally:
        daemon.stop()
    if switch:
        with DaemonProcess(str(opts.base), socket_root, workdir / "daemon-base.log", args,
                           env=_child_env(opts)) as d2:
            promote(str(opts.base), socket_root=socket_root)
            d2.start()
            _run_engines(opts, switch, socket_root, workdir)
    for p in to_run:
        _judge(opts, p)
    report.cases = [p.result for p in prepared]
    if not self_test and opts.record_golden and report.verdict == PASS:
        report.golden = record_golden(opts, candidate)


def _prepare(opts: GateOptions, case: GateCase, base: Path, candidate: Path, daemon_digest: str,
             workdir: Path, socket_root: str, self_test: bool) -> _Prepared:
    # NOT_RUN until judged: only _judge turns a case into PASS or BLOCK.
    res = CaseResult(case.name, case.description, case.expect, case.weights_equal, settings_json(case), NOT_RUN,
                     daemon_digest=content_digest(opts.base) if (case.holds_base and opts.base) else daemon_digest)
    res.not_run_reason = "not judged"
    p = _Prepared(case, res)
    is_moe = _model_is_moe(base) if case.settings.data_parallel_size != BASE_SETTINGS.data_parallel_size else False
    if is_moe is None:
        res.not_run_reason = ("whether the model is MoE (which decides if DP changes its key) is vLLM's "
                              "answer, and vLLM is not importable here")
        return p
    p.is_moe = is_moe
    check = case.key_check(daemon_digest, is_moe)
    p.mismatched_fields = check.mismatched_fields
    res.key_check = check.to_json() if case.recipe is None else None
    skip = case.cpu_skip
    if case.name == "tp_shift" and opts.run_tp:
        skip = ""
    if skip:
        res.status, res.not_run_reason = NOT_RUN, skip
        return p
    opts.note("prepare", case.name)
    if case.recipe is not None:
        staged = case.recipe.stage(base, workdir / "stage")
        prints = all_prints(staged) if case.recipe.in_place else None
        if case.recipe.in_place:
            # The staged copy is promoted before the overwrite: a stat-mode
            # engine then finds a manifest that the overwrite made stale.
            from preload.promote import promote

            promote(staged, socket_root=socket_root)
        cand = case.recipe.apply(staged, workdir / "cand")
        if not case.recipe.in_place:
            # An operator promotes what they serve; engines never hash or
            # write manifests (a missing one is a miss, issue 11).
            from preload.promote import promote

            promote(cand, socket_root=socket_root)
        res.fingerprints = fingerprint_matrix(base, cand, prints)
    else:
        cand = candidate if not self_test else base
    p.candidate = cand
    res.candidate = str(cand)
    res.candidate_digest = content_digest(cand)
    # The required outcome, from the digests and keys the gate computed.
    res.expect = expected_outcome(res.candidate_digest, res.daemon_digest, p.mismatched_fields)
    if res.expect != case.expect:
        res.notes.append(f"the catalogue reads this case as a {case.expect}; the digests and keys "
                         f"require a {res.expect}")
    common = case.engine_kwargs()
    p.reference_spec = EngineSpec(checkpoint=str(cand), **common)
    extra: dict[str, Any] = {"fallback": res.expect == "miss", "identity": "stat",
                             "socket_root": socket_root}
    if opts.unsafe_identity:
        extra["unsafe_identity"] = opts.unsafe_identity
    if opts.unsafe_silent_fallback:
        extra["unsafe_silent_fallback"] = True
    env = _child_env(opts)
    p.cached_spec = EngineSpec(checkpoint=str(cand), load_format="verified_cache", extra_config=extra,
                               env=env, **common)
    if case.server:
        p.reference_spec = dataclasses.replace(p.reference_spec, server=True)
        p.cached_spec = dataclasses.replace(p.cached_spec, server=True)
    res.not_run_reason = "not judged (its engines did not run)"
    return p


def _run_engines(opts: GateOptions, prepared: list[_Prepared], socket_root: str, workdir: Path) -> None:
    """Every reference (deduplicated, from the cache where possible) and every
    cached engine, ``opts.jobs`` at a time."""
    refs = ReferenceCache(opts.reference_cache, opts.progress, opts.engine_timeout_s)
    version = vllm_version()
    ref_jobs: dict[str, EngineSpec] = {}
    ref_names: dict[str, str] = {}
    for p in prepared:
        assert p.reference_spec is not None and p.cached_spec is not None
        key = refs.key(p.result.candidate_digest, p.reference_spec, version)
        hit = refs.get(key)
        if hit is not None:
            p.result.reference, p.result.reference_reused = hit, True
        elif key not in ref_jobs:
            ref_jobs[key] = p.reference_spec
            ref_names[key] = p.case.name
    # Cached engines first: their results do not depend on the references,
    # and a reference another run is computing meanwhile (the demo's other
    # lane) is then most likely stored by the time this run asks for it.
    tasks: list[tuple[str, str, EngineSpec]] = [("cached", p.case.name, p.cached_spec) for p in prepared
                                                 if p.cached_spec is not None]
    tasks += [("reference", k, s) for k, s in ref_jobs.items()]
    done: dict[tuple[str, str], EngineResult] = {}
    reused: set[str] = set()
    total = len(tasks)

    cores = CorePool(opts.jobs, opts.cores)

    def one(task: tuple[str, str, EngineSpec]) -> None:
        kind, name, pending = task

        def run() -> EngineResult:
            with cores.pinned(pending) as spec:
                return _one(kind, name, spec)

        if kind == "cached":
            done[(kind, name)] = run()
        else:  # waiting for another run's engine holds no core
            done[(kind, name)], was_reused = refs.reference([name], run, what=pending.checkpoint)
            if was_reused:
                reused.add(name)
                opts.note("engine-done", f"reference {ref_names[name]} ({len(done)}/{total}, "
                          "reused: another run stored it meanwhile)")

    def _one(kind: str, name: str, spec: EngineSpec) -> EngineResult:
        label = name if kind == "cached" else ref_names[name]
        opts.note("engine-start", f"{kind} {label}")
        wd = workdir / "engines" / f"{kind}-{label}-{name[:12]}"
        # A DP server starts an API process and one engine core per replica.
        timeout = opts.engine_timeout_s * (1 + spec.data_parallel_size) if spec.server else opts.engine_timeout_s
        result = run_engine(spec, wd, timeout_s=timeout)
        opts.note("engine-done", f"{kind} {label} ({len(done) + 1}/{total}, "
                  f"{'ok' if result.ok else 'failed'}, {result.timings.get('wall', 0):.0f} s)")
        return result

    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        list(pool.map(one, tasks))
    for p in prepared:
        p.result.cached = done[("cached", p.case.name)]
        if p.result.reference is None:
            assert p.reference_spec is not None
            key = refs.key(p.result.candidate_digest, p.reference_spec, version)
            p.result.reference = done[("reference", key)]
            p.result.reference_reused = key in reused


def _judge(opts: GateOptions, p: _Prepared) -> None:
    r = p.result
    assert r.reference is not None and r.cached is not None
    exp = Expectation(
        outcome=r.expect,
        candidate_digest=r.candidate_digest,
        daemon_digest=r.daemon_digest,
        ranks=p.case.settings.tensor_parallel_size,
        expected_fields=tuple(p.mismatched_fields) or p.case.expected_fields,
        dp_size=p.case.settings.data_parallel_size,
        is_moe=p.is_moe,
    )
    verdict = judge(exp, r.reference, r.cached, opts.tolerance)
    r.record(verdict)
    opts.note("verdict", f"{r.name}: {r.status} {' '.join(verdict.reasons)}")
