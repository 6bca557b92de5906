"""One runner for every cache target: candidates, caches, engines, verdicts.

For each case: the candidate comes from the mutation table, derived from a
private copy of the base in the target's format; the target prepares its
cache from the base under the case's cache settings (once per distinct
settings); an ``auto`` engine on the candidate is the reference, the
target's engine on the candidate is judged against it.

Engines are deduplicated where that is honest: two ``auto`` references with
the same values digest and settings are one run (see
:func:`harness.targets.checkpoints.values_digest`), two cached engines
with the same spec are one run (a sharded-state engine reads the derived
files only, whatever the candidate). References are shared with the gate's
on-disk reference cache, under the candidate's file digest and its values
digest.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engine import CorePool, EngineResult, EngineSpec, run_engine
from harness.mutations import EngineSettings, GateCase
from harness.results import CaseResult, GateReport, PreparedCase
from harness.targets.base import CacheTarget, PreparedCache
from harness.targets.checkpoints import file_digest, make_candidate, stage_base, values_digest
from harness.targets.judge import judge_served
from harness.verdict import NOT_RUN, expected_outcome
from pgbase.errors import PreloadGateError


@dataclass
class _Case(PreparedCase):
    cache: PreparedCache | None = None
    ref_key: str = ""
    cached_key: str = ""
    shared_with: str = ""
    log_label: str = ""


def run_target(target: CacheTarget, opts: Any, cases: list[GateCase], report: GateReport,
               promotion_candidate: Path | None = None) -> None:
    """Judge ``cases`` for ``target``; fills ``report.cases`` (and ``report.error``).

    ``opts`` is the gate's :class:`harness.gate.GateOptions`. With
    ``promotion_candidate`` the one case is that checkpoint served through a
    cache built from ``opts.base`` (or from itself).
    """
    note: Callable[[str, str], None] = opts.progress or (lambda _s, _m: None)
    reason = target.unavailable()
    if reason:
        report.cases = [_not_run(c, reason) for c in cases]
        return
    own = opts.workdir is None
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix=f"preload-gate-{target.name}-"))
    caches: dict[EngineSettings, PreparedCache] = {}
    try:
        for sub in ("base", "stage", "cand", "engines", "caches"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
        base_src = Path(opts.base or opts.candidate)
        note("prepare", f"{target.name}: staging the base ({target.checkpoint_format}) from {base_src}")
        staged = stage_base(base_src, target.checkpoint_format, workdir / "base")
        base_digest = file_digest(staged)
        items: list[_Case] = []
        for case in cases:
            res = CaseResult(case.name, case.description, case.expect, case.weights_equal,
                             case.settings.to_json(), NOT_RUN)
            items.append(_Case(case, res))
            why = target.case_unavailable(case)
            if why:
                res.not_run_reason = why
                continue
            if case.cache_settings not in caches:
                note("prepare", f"{target.name}: preparing the cache from the base "
                     f"(TP={case.cache_settings.tensor_parallel_size})")
                try:
                    caches[case.cache_settings] = target.prepare(
                        staged, case.cache_settings, workdir / "caches" / f"tp{case.cache_settings.tensor_parallel_size}",
                        opts.engine_timeout_s)
                except PreloadGateError as exc:
                    report.error = f"{target.name}: preparing the cache failed: {exc}"
                    res.not_run_reason = f"the cache could not be prepared: {exc}"
                    continue
            items[-1].cache = caches[case.cache_settings]
        # Candidates are made after the caches: whatever a cache put into the
        # base directory travels with a copy, as it does for an operator.
        for it in items:
            if it.cache is None:
                continue
            note("prepare", f"{target.name}: {it.case.name}")
            if promotion_candidate is not None:
                cand = _promotion_copy(promotion_candidate, target, workdir)
            else:
                cand = make_candidate(it.case, staged, workdir, target.checkpoint_format)
            target.place(it.cache, cand)
            it.candidate = cand
            it.result.candidate = str(cand)
            it.result.candidate_digest = file_digest(cand)
            it.result.daemon_digest = it.cache.source_digest or base_digest
            # What a correct cache must do, from the digests (not the case's name).
            it.result.expect = expected_outcome(it.result.candidate_digest, it.result.daemon_digest,
                                                it.case.expected_fields)
            common = it.case.engine_kwargs()  # a promotion case: with the deployment's settings
            it.reference_spec = EngineSpec(checkpoint=str(cand), **common)
            it.cached_spec = target.cached_spec(it.cache, it.case, cand, common)
        _run_engines(target, opts, [it for it in items if it.cached_spec is not None], workdir, note)
        for it in items:
            if it.cached_spec is None or it.cache is None:
                continue
            r = it.result
            assert r.reference is not None and r.cached is not None
            assert it.candidate is not None
            served = target.served(it.cache, it.case, it.candidate, r.candidate_digest, r.cached,
                                   _log_text(workdir / "engines" / f"cached-{it.log_label}" / "engine.log"))
            if it.shared_with:
                served.notes.append(f"the cached engine is the one run for {it.shared_with}: the same spec "
                                    "(it reads the same cache files whatever the candidate)")
            r.cached.events = served.events or r.cached.events
            verdict = judge_served(target, it.case, r, served, opts.tolerance)
            r.record(verdict)
            note("verdict", f"{target.name} {r.name}: {r.status} {' '.join(verdict.reasons)}")
    finally:
        for cache in caches.values():
            target.close(cache)
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    report.cases = [it.result for it in items]


def _promotion_copy(candidate: Path, target: CacheTarget, workdir: Path) -> Path:
    """The candidate is never written into (npcache dumps into its directory): a copy."""
    return stage_base(candidate, target.checkpoint_format, workdir / "cand" / "promotion")


def _log_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _not_run(case: GateCase, reason: str) -> CaseResult:
    return CaseResult(case.name, case.description, case.expect, case.weights_equal,
                      case.settings.to_json(), NOT_RUN, not_run_reason=reason)


def _ref_keys(refs: Any, spec: EngineSpec, candidate: Path, file_dig: str, version: str | None) -> list[str]:
    keys = [refs.key(file_dig, spec, version)]
    keys.append(refs.key("values:" + values_digest(candidate, spec.dtype), spec, version))
    return keys


def _run_engines(target: CacheTarget, opts: Any, items: list[_Case], workdir: Path,
                 note: Callable[[str, str], None]) -> None:
    from harness.gate.references import ReferenceCache, vllm_version

    refs = ReferenceCache(opts.reference_cache, opts.progress, opts.engine_timeout_s)
    version = vllm_version()
    ref_jobs: dict[str, tuple[str, EngineSpec, list[str]]] = {}
    cached_jobs: dict[str, tuple[str, EngineSpec]] = {}
    known: dict[str, EngineResult] = {}
    reused: set[str] = set()
    for it in items:
        assert it.reference_spec is not None and it.cached_spec is not None and it.candidate is not None
        keys = _ref_keys(refs, it.reference_spec, it.candidate, it.result.candidate_digest, version)
        it.ref_key = keys[-1]
        hit = next((r for r in (refs.get(k) for k in keys) if r is not None), None)
        if hit is not None:
            known[it.ref_key] = hit
            it.result.reference_reused = True
            for k in keys:
                refs.put(k, hit)
        elif it.ref_key not in ref_jobs:
            ref_jobs[it.ref_key] = (it.case.name, it.reference_spec, keys)
        it.cached_key = json.dumps(it.cached_spec.to_json(), sort_keys=True)
        if it.cached_key not in cached_jobs:
            cached_jobs[it.cached_key] = (it.case.name, it.cached_spec)
    # Cached engines first: a reference another run computes meanwhile (the
    # demo's other lane) is then most likely stored when this run asks.
    tasks = [("cached", k, label, spec) for k, (label, spec) in cached_jobs.items()]
    tasks += [("reference", k, label, spec) for k, (label, spec, _) in ref_jobs.items()]
    done: dict[tuple[str, str], EngineResult] = {}
    cores = CorePool(opts.jobs, opts.cores)
    env = target.child_env()

    def one(task: tuple[str, str, str, EngineSpec]) -> None:
        kind, key, label, pending = task

        def run() -> EngineResult:
            with cores.pinned(pending, env) as spec:
                note("engine-start", f"{target.name} {kind} {label}")
                t0 = time.monotonic()
                worker = getattr(target, "engine_worker" if kind == "cached" else "reference_worker",
                                 "harness.engine_worker")
                result = run_engine(spec, workdir / "engines" / f"{kind}-{label}", timeout_s=opts.engine_timeout_s,
                                    worker=worker)
                note("engine-done", f"{target.name} {kind} {label} ({len(done) + 1}/{len(tasks)}, "
                     f"{'ok' if result.ok else 'failed'}, {time.monotonic() - t0:.0f} s)")
                return result

        if kind == "cached":
            done[(kind, key)] = run()
            return
        # Waiting for another run's engine holds no core.
        done[(kind, key)], was_reused = refs.reference(ref_jobs[key][2], run, what=pending.checkpoint)
        if was_reused:
            reused.add(key)
            note("engine-done", f"{target.name} reference {label} (reused: another run stored it meanwhile)")

    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        list(pool.map(one, tasks))
    for it in items:
        it.result.reference = known.get(it.ref_key) or done[("reference", it.ref_key)]
        it.result.reference_reused = it.result.reference_reused or it.ref_key in reused
        cached = done[("cached", it.cached_key)]
        # Each case gets its own copy: served() may attach events to it.
        it.result.cached = EngineResult.from_json(json.loads(json.dumps(cached.to_json())))
        first = cached_jobs[it.cached_key][0]
        it.log_label = first
        if first != it.case.name:
            it.shared_with = first
