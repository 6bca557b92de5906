"""One runner for every cache target: candidates, caches, engines, verdicts.

For each case: the candidate comes from the mutation table (derived from the
base, or from a private copy of it in the target's format when the target
writes into its base, ``stages_base``), or is the promoted checkpoint
itself; the target prepares its cache from the case's source (the base, or
``--base`` for a switch case) under the case's cache settings, once per
distinct (source, settings), through the executor (a daemon on every node
that will run the cached engines); an ``auto`` engine on the candidate is
the reference, the target's engine on the candidate is judged against it.
Caches are prepared and closed one group after another (a GPU holds one
daemon of a model, not two).

Digests come from :class:`harness.targets.digests.Digests`: the promotion's,
carried with its proof, hashed again only where a rule says the bytes may
have changed. The required outcome of a case follows from those digests and
from the product's key rule, never from the case's name.

Engines are deduplicated where that is honest: two ``auto`` references with
the same key are one run (in a self-test also keyed by the values digest,
:func:`harness.targets.checkpoints.values_digest`, so a ``.bin`` copy shares
the reference of its safetensors source), two cached engines with the same
spec are one run (a sharded-state engine reads the derived files only,
whatever the candidate).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.gate.cases import settings_json
from harness.gate.fingerprints import all_prints, fingerprint_matrix
from harness.gate.references import ReferenceCache, vllm_version
from harness.gate.schedule import EngineJob, Executor, Outcome, Placement, run_jobs
from harness.mutations import BASE_SETTINGS, EngineSettings, GateCase
from harness.results import CaseResult, GateReport, PreparedCase
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache
from harness.targets.checkpoints import make_candidate, stage_base, values_digest
from harness.targets.digests import Digests
from harness.targets.judge import judge_served
from harness.verdict import NOT_RUN, expected_outcome
from pgbase.errors import PreloadGateError
from preload.identity.config import config_digest


@dataclass
class _Case(PreparedCase):
    caches: list[PreparedCache] | None = None
    source: Path | None = None
    is_moe: bool = False
    mismatched_fields: tuple[str, ...] = ()
    ref_key: str = ""
    ref_keys: tuple[str, ...] = ()
    cached_key: str = ""
    log_label: str = ""  # the case whose name the (shared) cached engine ran under
    choices: list[Placement] | None = None


@dataclass
class RunPlan:
    """What :func:`run_cases` needs besides the cases (built by :func:`harness.gate.run_gate`)."""

    target: CacheTarget
    executor: Executor
    digests: Digests
    ctx: PrepareContext  # its workdir is the run's
    base: Path  # self-test: the base mutated; promotion: the candidate
    alt_base: Path | None  # --base: what a switch case's cache holds
    self_test: bool
    run_tp: bool
    tolerance: float
    reference_cache: str | None
    progress: Any = None


def _model_is_moe(checkpoint: Path) -> bool | None:
    """vLLM's own answer (``ModelConfig.is_moe``); None when vLLM is absent."""
    try:
        from vllm.config import ModelConfig
    except ImportError:
        return None
    return bool(ModelConfig(model=str(checkpoint)).is_moe)


def _not_run(res: CaseResult, reason: str) -> None:
    res.status, res.not_run_reason = NOT_RUN, reason


def run_cases(plan: RunPlan, cases: list[GateCase], report: GateReport) -> None:
    """Judge ``cases`` for ``plan.target``; fills ``report.cases`` (and ``report.error``)."""
    target, note, work = plan.target, plan.ctx.note, plan.ctx.workdir
    items = [_start(plan, c) for c in cases]
    report.cases = [it.result for it in items]
    reason = target.unavailable()
    if reason:
        for it in items:
            _not_run(it.result, reason)
        return
    for sub in ("base", "stage", "cand", "engines", "caches"):  # a reused --workdir starts clean
        shutil.rmtree(work / sub, ignore_errors=True)
    live = [it for it in items if it.result.not_run_reason == "not judged"]
    if not live:
        return
    # The base the cases derive from: a private copy where the target writes into it.
    staged: dict[Path, Path] = {}

    def source_of(it: _Case) -> Path:
        src = plan.alt_base if (it.case.holds_base and plan.alt_base is not None) else plan.base
        if target.stages_base and src not in staged:
            note("prepare", f"{target.name}: staging {src} ({target.checkpoint_format})")
            staged[src] = stage_base(src, target.checkpoint_format, work / "base" / f"b{len(staged)}")
        return staged.get(src, src)

    groups: dict[tuple[Path, EngineSettings], list[_Case]] = {}
    for it in live:
        it.source = source_of(it)
        groups.setdefault((it.source, it.case.cache_settings), []).append(it)
    for n, ((source, settings), members) in enumerate(groups.items()):
        gctx = dataclasses.replace(plan.ctx, workdir=work / "caches" / f"c{n}")
        gctx.workdir.mkdir(parents=True, exist_ok=True)
        note("prepare", f"{target.name}: preparing the cache from {source} "
             f"(TP={settings.tensor_parallel_size})")
        try:
            caches = plan.executor.prepare(target, source, settings, gctx)
        except PreloadGateError as exc:
            report.error = f"{target.name}: preparing the cache failed: {exc}"
            for it in members:
                it.result.not_run_reason = f"the cache could not be prepared: {exc}"
            continue
        try:
            if not report.daemon and "digest" in caches[0].info and not members[0].case.holds_base:
                report.daemon = {k: v for k, v in caches[0].info.items() if k != "controls"}
                report.daemon["nodes"] = [c.node for c in caches if c.node]
            ready = []
            for it in members:
                it.caches = caches
                try:
                    _candidate(plan, it, gctx)
                except PreloadGateError as exc:
                    it.result.not_run_reason = f"the candidate could not be made: {exc}"
                    continue
                ready.append(it)
            _run_engines(plan, ready)
        finally:
            plan.executor.close(target, caches)
    for it in live:
        if it.result.reference is not None and it.result.cached is not None:
            _judge(plan, it)
        elif it.result.status == NOT_RUN and it.result.not_run_reason == "not judged":
            it.result.not_run_reason = "not judged (its engines did not run)"


def prepare_case(plan: RunPlan, case: GateCase, cache: PreparedCache) -> _Case:
    """One case up to its engines against a cache already prepared: its row,
    key check, candidate, digests, required outcome and both specs (what a
    test checks without engines). NOT_RUN until judged (:func:`judge_case`)."""
    it = _start(plan, case)
    if it.result.not_run_reason == "not judged":
        it.source = plan.alt_base if (case.holds_base and plan.alt_base is not None) else plan.base
        it.caches = [cache]
        _candidate(plan, it, plan.ctx)
    return it


def judge_case(plan: RunPlan, it: _Case) -> None:
    """Judge a case whose two engine results are set (``it.result.reference``, ``.cached``)."""
    it.log_label = it.log_label or it.case.name
    _judge(plan, it)


def _start(plan: RunPlan, case: GateCase) -> _Case:
    """The case's report row, NOT_RUN until judged, and what needs no engine."""
    res = CaseResult(case.name, case.description, case.expect, case.weights_equal, settings_json(case), NOT_RUN)
    res.not_run_reason = "not judged"
    it = _Case(case, res)
    why = plan.target.case_unavailable(case)
    if why:
        _not_run(res, why)
        return it
    if case.settings.data_parallel_size != BASE_SETTINGS.data_parallel_size:
        is_moe = _model_is_moe(plan.base)
        if is_moe is None:
            _not_run(res, "whether the model is MoE (which decides if DP changes its key) is vLLM's "
                          "answer, and vLLM is not importable here")
            return it
        it.is_moe = is_moe
    # The key check needs no digest of its own: both keys carry the same one.
    check = case.key_check("0" * 64, it.is_moe)
    it.mismatched_fields = check.mismatched_fields
    res.key_check = check.to_json() if case.recipe is None else None
    skip = "" if (case.name == "tp_shift" and plan.run_tp) else case.cpu_skip
    if skip:
        _not_run(res, skip)
    return it


def _candidate(plan: RunPlan, it: _Case, ctx: PrepareContext) -> None:
    """Make the case's candidate, take its digest, the required outcome and both specs."""
    target, digests, case, res = plan.target, plan.digests, it.case, it.result
    assert it.caches and it.source is not None
    cache = it.caches[0]
    plan.ctx.note("prepare", f"{target.name}: {case.name}")
    fmt = target.checkpoint_format
    work = plan.ctx.workdir
    if case.recipe is None:
        if plan.self_test or not target.stages_base:
            cand = it.source if plan.self_test else plan.base
        else:  # the candidate is never written into (npcache dumps into its directory): a copy
            cand = stage_base(plan.base, fmt, work / "cand" / f"promotion-{case.name}")
        target.place(cache, cand, ctx)
        digest = digests.of(cand)
    else:
        prints: dict[str, str] | None = None

        def before_edit(staged: Path) -> None:
            nonlocal prints
            if target.reports_fingerprints:
                prints = all_prints(staged)
            target.before_edit(cache, staged, ctx)

        cand = make_candidate(case, it.source, work, fmt, before_edit=before_edit)
        if case.in_place:
            # The gate overwrote these bytes itself (mtimes maybe restored:
            # the stat check is what the case tests): hashed, never taken on
            # stats; and not placed again (the operator's act was before_edit).
            digest = digests.hash_now(cand)
        else:
            target.place(cache, cand, ctx)
            digest = digests.of(cand)
        if target.reports_fingerprints:
            res.fingerprints = fingerprint_matrix(it.source, cand, prints)
    it.candidate = cand
    res.candidate, res.candidate_digest = str(cand), digest
    res.daemon_digest = cache.source_digest
    if case.holds_base and config_digest(cand) != config_digest(it.source):
        # The engine's key holds the candidate's config.json, the daemon's the base's: observed, a miss.
        it.mismatched_fields = (*it.mismatched_fields, "config_digest")
    res.expect = expected_outcome(res.candidate_digest, res.daemon_digest, it.mismatched_fields)
    res.weights_equal = res.candidate_digest == res.daemon_digest  # observed, not the catalogue's
    if res.expect != case.expect:
        res.notes.append(f"the catalogue reads this case as a {case.expect}; the digests and keys "
                         f"require a {res.expect}")
    common = case.engine_kwargs()  # a promotion case: with the deployment's settings
    it.reference_spec = EngineSpec(checkpoint=str(cand), server=case.server, **common)
    it.choices = [Placement(c.node, dataclasses.replace(target.cached_spec(c, case, cand, common, res.expect),
                                                        server=case.server)) for c in it.caches]
    it.cached_spec = it.choices[0].spec
    res.not_run_reason = "not judged (its engines did not run)"


def _run_engines(plan: RunPlan, items: list[_Case]) -> None:
    target = plan.target
    refs = ReferenceCache(plan.reference_cache, plan.progress, plan.ctx.engine_timeout_s)
    version = vllm_version()
    work = plan.ctx.workdir / "engines"
    jobs: dict[str, EngineJob] = {}
    known: dict[str, EngineResult] = {}
    env = {**plan.ctx.env, **target.child_env()}
    timeout = plan.ctx.engine_timeout_s
    for it in items:
        assert it.reference_spec is not None and it.choices and it.candidate is not None
        spec = it.reference_spec
        keys = [refs.key(it.result.candidate_digest, spec, version)]
        if plan.self_test:  # candidates the gate derived: shared across formats by their values
            keys.append(refs.key("values:" + values_digest(it.candidate, spec.dtype), spec, version))
        it.ref_keys, it.ref_key = tuple(keys), "ref:" + keys[-1]
        hit = next((r for r in (refs.get(k) for k in keys) if r is not None), None)
        if hit is not None:
            known[it.ref_key] = hit
            it.result.reference_reused = True
            for k in keys:
                if refs.get(k) is None:
                    refs.put(k, hit)
        elif it.ref_key not in jobs:
            # A DP server starts an API process and one engine core per replica.
            t = timeout * (1 + spec.data_parallel_size) if spec.server else timeout
            jobs[it.ref_key] = EngineJob("reference", it.ref_key, it.case.name, [Placement(None, spec)],
                                         target.reference_worker, work / f"reference-{it.case.name}", t,
                                         env, ref_keys=it.ref_keys)
        it.cached_key = "cached:" + json.dumps(it.choices[0].spec.to_json(), sort_keys=True)
        if it.ref_key in jobs:
            jobs[it.ref_key].after.append(it.cached_key)
        if it.cached_key not in jobs:
            spec = it.choices[0].spec
            t = timeout * (1 + spec.data_parallel_size) if spec.server else timeout
            jobs[it.cached_key] = EngineJob("cached", it.cached_key, it.case.name, list(it.choices),
                                            target.engine_worker, work / f"cached-{it.case.name}", t, env)
    done = run_jobs(list(jobs.values()), plan.executor, refs, plan.ctx.note)
    for it in items:
        cached = done[("cached", it.cached_key)]
        ref = known.get(it.ref_key) or done[("reference", it.ref_key)].result
        ref_out = done.get(("reference", it.ref_key))
        if ref_out is not None and ref_out.reused:
            it.result.reference_reused = True
        it.log_label = jobs[it.cached_key].label
        _attach(it, cached, ref_out, ref)


def _attach(it: _Case, cached: Outcome, ref_out: Outcome | None, ref: EngineResult) -> None:
    r = it.result
    r.placement = {"cached": {"node": cached.node, "attempts": cached.attempts},
                   "reference": {"node": ref_out.node if ref_out else None,
                                 "attempts": ref_out.attempts if ref_out else [], "reused": r.reference_reused}}
    for what, out in (("cached", cached), ("reference", ref_out)):
        if out is not None and out.not_run:
            _not_run(r, f"the {what} engine was not run: {out.not_run}")
            return
    r.reference = ref
    # Each case gets its own copy: served() may attach events to it.
    r.cached = EngineResult.from_json(json.loads(json.dumps(cached.result.to_json())))
    if it.log_label != it.case.name:
        r.notes.append(f"the cached engine is the one run for {it.log_label}: the same spec "
                       "(it reads the same cache files whatever the candidate)")


def _contradiction(plan: RunPlan, it: _Case) -> str:
    """What the case's observations say against each other ("" where nothing):
    an engine given the candidate's path that saw other content there (its
    ``weights_digest``, taken where it ran), or a node's daemon holding other
    content than the driver's digest of its source. Such a case judged nothing
    about the candidate: NOT_RUN, naming the node, the path and both digests."""
    r = it.result
    assert r.reference is not None and r.cached is not None and it.caches and it.source is not None
    assert it.reference_spec is not None and it.cached_spec is not None
    found = []
    for what, result, path in (("cached", r.cached, it.cached_spec.checkpoint),
                               ("reference", r.reference, it.reference_spec.checkpoint)):
        node = (r.placement.get(what) or {}).get("node")
        where = f"node {node}" if node else "this machine"
        if path == str(it.candidate) and result.weights_digest and result.weights_digest != r.candidate_digest:
            found.append(f"the {what} engine on {where} saw other content at {path}: digest {result.weights_digest}, "
                          f"the promoted candidate's is {r.candidate_digest}")
    node = (r.placement.get("cached") or {}).get("node")
    cache = next((c for c in it.caches if c.node is not None and c.node == node), None)
    if cache is not None:  # a daemon a node prepared from its own view of the source
        r.daemon_digest = cache.source_digest
        driver = plan.digests.of(it.source)
        if cache.source_digest != driver:
            found.append(f"the daemon on node {node} holds {cache.source_digest} from {it.source}, where this "
                         f"run's digest of {it.source} is {driver}")
    return "; ".join(found)


def _judge(plan: RunPlan, it: _Case) -> None:
    r, target = it.result, plan.target
    assert r.reference is not None and r.cached is not None and it.candidate is not None and it.caches
    contradiction = _contradiction(plan, it)
    if contradiction:
        _not_run(r, f"contradicting observations: {contradiction}")
        plan.ctx.note("verdict", f"{target.name} {r.name}: {NOT_RUN} {contradiction}")
        return
    log = _log_text(plan.ctx.workdir / "engines" / f"cached-{it.log_label}" / "engine.log")
    served = target.served(it.caches[0], it.case, it.candidate, r.candidate_digest, r.cached, log)
    r.cached.events = served.events or r.cached.events
    verdict = judge_served(target, it.case, r, served, plan.tolerance, it.mismatched_fields, it.is_moe)
    r.record(verdict)
    plan.ctx.note("verdict", f"{target.name} {r.name}: {r.status} {' '.join(verdict.reasons)}")


def _log_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
