"""The gate report a rollout believes: bound to the candidate, the settings and the golden.

A report is a file any local user can write, so "verdict: PASS" in it
proves nothing by itself. What a rollout checks, each refusal one line
naming the report and the binding that failed (:class:`ReportRefusedError`):

- it is a promotion report of our own cache (``verified_cache``), with no
  negative control switched on, a logprob tolerance no looser than the
  gate's, and the vLLM installed here;
- every case ran on the candidate's content, by a digest computed HERE
  (the caller's, never the report's word), under the deployment's settings
  (each differing field named);
- every verdict is judged again from the report's own evidence (the load
  events, the cached and ``auto`` engines' tokens and logprobs) by the
  gate's own judge (:func:`harness.verdict.judge`), with the expectation
  taken from our digests: a BLOCK edited into a PASS, or a report of
  another checkpoint with its digest fields edited, is refused because its
  events name other content or its tokens disagree;
- the golden is the one this gate recorded: its SHA-256 is the report's
  (or, for a report run with ``--no-golden`` and a golden recorded beside
  it, as ``ci/promote_pipeline.sh`` does, the operator names it), it is
  keyed by the candidate's digest and the same settings and vLLM, and its
  answers begin with the gate's ``auto`` reference answers (the reference
  stops at EOS, the golden runs on with ``ignore_eos``).

A forger who rewrites the report, its events, its tokens and the golden
consistently still meets the canary: the first replica answers with the
candidate's real weights, not with the forged golden's, and is rolled back.
This binds what a careless or copied report could get wrong; it is not a
signature against a determined local user, who could as well edit the code.

>>> evidence = verify_gate_report("promotion/gate", digest, settings)  # doctest: +SKIP
>>> evidence.golden  # doctest: +SKIP
PosixPath('promotion/gate/golden.json')
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from canaries.errors import GoldenError
from canaries.golden import Golden, load_golden
from harness.engine import EngineResult
from harness.gate.references import vllm_version
from harness.verdict import LOGPROB_TOLERANCE, PASS, Expectation, expected_outcome, judge
from pgbase.errors import PreloadGateError
from preload.deployment import DeploymentSettings, SettingsError

TARGET = "verified_cache"


class ReportRefusedError(PreloadGateError):
    """A gate report (or its golden) that does not prove this candidate passed under these settings."""


@dataclass(frozen=True)
class GateEvidence:
    """A report that passed every binding: where it and its golden are, and what it covered."""

    report: Path
    golden: Path
    digest: str
    cases: tuple[str, ...]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"report": str(self.report), "golden": str(self.golden), "digest": self.digest,
                "cases": list(self.cases), "notes": list(self.notes)}


def _report_path(where: str | os.PathLike[str]) -> Path:
    p = Path(where)
    return p / "report.json" if p.is_dir() else p


def _refuse(path: Path, why: str) -> ReportRefusedError:
    return ReportRefusedError(f"gate report {path} refused: {why}")


def _case_settings(case: dict[str, Any], path: Path) -> DeploymentSettings:
    raw = case.get("settings") or {}
    names = {f.name for f in fields(DeploymentSettings)}
    try:
        return DeploymentSettings.from_json({k: v for k, v in raw.items() if k in names})
    except SettingsError as exc:
        raise _refuse(path, f"case {case.get('name')!r} records unreadable settings ({exc})") from None


def _differs(a: DeploymentSettings, b: DeploymentSettings) -> str:
    return ", ".join(f"{f}={getattr(a, f)} (deployment: {getattr(b, f)})" for f in a.mismatched_fields(b))


def _rejudge(case: dict[str, Any], digest: str, settings: DeploymentSettings, tolerance: float,
             path: Path, key_fields: tuple[str, ...] = ()) -> None:
    """The case's verdict from its own evidence and OUR digest of the candidate;
    ``key_fields``: the key fields the rollout observed differ between the
    case's daemon and its engine besides the digest (``config_digest``)."""
    name = case.get("name")
    daemon_digest = str(case.get("daemon_digest") or "")
    try:
        reference = EngineResult.from_json(case.get("reference") or {"ok": False, "error": "absent"})
        cached = EngineResult.from_json(case.get("cached") or {"ok": False, "error": "absent"})
    except TypeError as exc:
        raise _refuse(path, f"case {name!r}: engine results are malformed ({exc})") from None
    verdicts = []
    # Whether DP ranks number the daemon's ranks depends on MoE, which the
    # report does not record; for DP=1 both readings are the same.
    for is_moe in ((False, True) if settings.data_parallel_size > 1 else (False,)):
        observed = (("content_digest",) if daemon_digest != digest else ()) + key_fields
        exp = Expectation(outcome=expected_outcome(digest, daemon_digest, observed), candidate_digest=digest,
                          daemon_digest=daemon_digest, ranks=settings.tensor_parallel_size,
                          expected_fields=observed,
                          dp_size=settings.data_parallel_size, is_moe=is_moe)
        verdicts.append(judge(exp, reference, cached, tolerance))
    if not any(v.status == PASS for v in verdicts):
        v = verdicts[0]
        raise _refuse(path, f"case {name!r} records {case.get('status')}, but its own evidence judges "
                            f"{v.status} ({'; '.join(v.details) or ', '.join(v.reasons)})")


def _golden_path(report: dict[str, Any], path: Path, given: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The golden to believe and how it is bound: ``sealed`` (the report names its
    SHA-256) or ``answers`` (recorded apart, as ci/promote_pipeline.sh does with
    ``gate --no-golden`` then ``canary record``: bound by its answers alone)."""
    g = report.get("golden") or {}
    if not g.get("recorded"):
        if given:
            return Path(given), "answers"
        raise _refuse(path, f"it records no golden ({g.get('note') or 'none'}); name the golden recorded beside it "
                            "with --golden (the pipeline's OUT/golden.json), or run the gate with --report DIR")
    want = g.get("sha256")
    if not isinstance(want, str) or len(want) != 64:
        raise _refuse(path, "it does not name its golden's SHA-256 (written by an older gate); run the gate again")
    candidates = [Path(given)] if given else [Path(str(g.get("path"))), path.parent / "golden.json"]
    for c in candidates:
        try:
            data = c.read_bytes()
        except OSError:
            continue
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            if given:
                raise _refuse(path, f"golden {c} is not the one this gate recorded (SHA-256 {got[:16]}, the "
                                    f"report names {want[:16]})")
            continue
        return c, "sealed"
    raise _refuse(path, f"the golden it recorded (SHA-256 {want[:16]}) is not at {', '.join(map(str, candidates))}")


def _check_golden(golden: Golden, gpath: Path, report: dict[str, Any], digest: str,
                  settings: DeploymentSettings, path: Path) -> None:
    if golden.digest != digest:
        raise _refuse(path, f"its golden {gpath} is keyed by digest {golden.digest[:16]}, the candidate is {digest[:16]}")
    if golden.settings is None or golden.settings.mismatched_fields(settings):
        what = _differs(golden.settings, settings) if golden.settings else "none recorded"
        raise _refuse(path, f"its golden {gpath} was recorded under other settings: {what}")
    if golden.vllm_version != report.get("vllm_version"):
        raise _refuse(path, f"its golden was recorded with vLLM {golden.vllm_version}, the gate ran "
                            f"{report.get('vllm_version')}")
    promotion = next(c for c in report["cases"] if c.get("name") == "promotion")
    ref = (promotion.get("reference") or {}).get("token_ids") or []
    if len(ref) != len(golden.prompts):
        raise _refuse(path, f"its golden holds {len(golden.prompts)} prompts, the gate's reference answered {len(ref)}")
    for p, (want, gp) in enumerate(zip(ref, golden.prompts, strict=True)):
        got = gp.token_ids[: len(want)]
        if got != list(want):
            i = next(k for k, (x, y) in enumerate(zip(want, got, strict=False)) if x != y) \
                if len(got) == len(want) else len(got)
            raise _refuse(path, f"its golden does not answer as the gate's auto reference did (prompt {p}, position "
                                f"{i}): the golden was not recorded from this candidate")


def read_gate_report(where: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The gate report at ``where`` (its directory or report.json), read and
    checked for what needs no checkpoint: a passing promotion gate of our
    cache, no negative controls, this host's vLLM, the gate's tolerance.
    Returns its path and content; raises :class:`ReportRefusedError`.
    A rollout runs this before anything is hashed."""
    path = _report_path(where)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportRefusedError(f"cannot read gate report {path}: {exc.strerror or exc}; give the --report DIR "
                                 "of the candidate's passing `preload-gate gate CANDIDATE --report DIR`") from None
    except ValueError as exc:
        raise _refuse(path, f"not JSON ({exc})") from None
    if not isinstance(report, dict) or report.get("tool") != "preload-gate" or not isinstance(report.get("cases"), list):
        raise _refuse(path, "not a preload-gate report")
    if report.get("mode") != "promotion":
        raise _refuse(path, f"it is a {report.get('mode')} report; a rollout needs the promotion gate of the "
                            "candidate (preload-gate gate CANDIDATE --report DIR)")
    if report.get("target") != TARGET:
        raise _refuse(path, f"it judged the {report.get('target')} cache; replicas load {TARGET}")
    on = sorted(k for k, v in (report.get("controls") or {}).items() if v and k != "run_tp")
    if on:
        raise _refuse(path, f"it ran with negative controls on ({', '.join(on)}): such a run proves nothing")
    if report.get("verdict") != PASS or report.get("exit_code") != 0:
        raise _refuse(path, f"the gate did not pass (verdict {report.get('verdict')}, exit {report.get('exit_code')})")
    here = vllm_version()
    if here is not None and report.get("vllm_version") != here:
        raise _refuse(path, f"the gate ran vLLM {report.get('vllm_version')}, this host serves {here}")
    tolerance = report.get("logprob_tolerance")
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not 0 <= tolerance <= LOGPROB_TOLERANCE:
        raise _refuse(path, f"its logprob tolerance {tolerance!r} is looser than the gate's {LOGPROB_TOLERANCE:g}")
    names = [c.get("name") for c in report["cases"] if isinstance(c, dict)]
    if "promotion" not in names or len(names) != len(report["cases"]):
        raise _refuse(path, "it holds no promotion case")
    return path, report


def verify_gate_report(where: str | os.PathLike[str], digest: str, settings: DeploymentSettings,
                       golden: str | os.PathLike[str] | None = None,
                       base_config_differs: bool = False) -> GateEvidence:
    """Check the gate report at ``where`` (its directory or report.json) against
    ``digest`` (the candidate's content digest, computed by the caller) and
    the deployment ``settings``; ``golden``: a golden file the operator
    names (it must be the report's); ``base_config_differs``: the caller saw
    the base's config.json differ from the candidate's (then the case run
    against the base's daemon, ``switch_from_base``, requires a miss on
    ``config_digest`` even with equal weights). Returns the evidence, or raises
    :class:`ReportRefusedError` naming the first binding that fails."""
    path, report = read_gate_report(where)
    tolerance = report["logprob_tolerance"]
    names = [c.get("name") for c in report["cases"]]
    for case in report["cases"]:
        if case.get("status") != PASS:
            raise _refuse(path, f"case {case.get('name')!r} is {case.get('status')}, not PASS")
        if case.get("candidate_digest") != digest:
            raise _refuse(path, f"case {case.get('name')!r} ran on content {str(case.get('candidate_digest'))[:16]}, "
                                f"the candidate's digest is {digest[:16]}: a report of another checkpoint")
        case_settings = _case_settings(case, path)
        if case_settings.mismatched_fields(settings):
            raise _refuse(path, f"case {case.get('name')!r} ran under other settings: {_differs(case_settings, settings)}; "
                                "gate the candidate with the deployment's engine arguments")
        if case.get("name") == "promotion" and case.get("daemon_digest") != digest:
            raise _refuse(path, f"its daemon held {str(case.get('daemon_digest'))[:16]}, not the candidate")
        fields = ("config_digest",) if base_config_differs and case.get("name") == "switch_from_base" else ()
        _rejudge(case, digest, settings, float(tolerance), path, fields)
    gpath, bound = _golden_path(report, path, golden)
    try:
        g = load_golden(gpath)
    except GoldenError as exc:
        raise _refuse(path, f"its golden cannot be read: {exc}") from None
    _check_golden(g, gpath, report, digest, settings, path)
    notes = [] if "switch_from_base" in names else ["the gate ran without --base: no case showed a daemon "
                                                    "holding the old checkpoint misses on this one"]
    if bound == "answers":
        notes.append(f"golden {gpath} was recorded apart from the report: bound by its digest, settings and "
                     "answers (equal to the gate's auto reference), not by a SHA-256 the report names")
    return GateEvidence(path, gpath, digest, tuple(str(n) for n in names), notes)
