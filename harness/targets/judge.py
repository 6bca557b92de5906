"""Verdicts for cache targets: with load events, or on output alone.

A target whose loads record events goes through :func:`harness.verdict.judge`
unchanged (hit/miss against the gate's own digests, then tokens and
logprobs). A target that records nothing cannot show what it served, so it
is judged on its output alone: PASS only when greedy tokens equal ``auto``'s
and the chosen-token logprobs agree within tolerance; the verdict says the
hit could not be proven, and lists what the gate knows about the cache
(what it was built from) as notes, never as proof of what was read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.mutations import GateCase
from harness.results import CaseResult
from harness.targets.base import Served
from harness.verdict import (
    PASS,
    Expectation,
    Verdict,
    compare_outputs,
    expected_outcome,
    judge,
    reference_unusable,
)

if TYPE_CHECKING:
    from harness.engine import EngineResult
    from harness.targets.base import CacheTarget

UNPROVEN = "no load event: the hit could not be proven; judged on tokens and logprobs against auto only"


def judge_output_only(reference: EngineResult, cached: EngineResult, served: Served, tolerance: float) -> Verdict:
    """PASS only when the cached engine's output equals ``auto``'s."""
    v = Verdict(status=PASS)
    if not reference.ok:
        v._block("error", f"the auto reference engine failed: {reference.error}")
    if not cached.ok:
        v._block("error", f"the cached engine failed: {cached.error}")
    if reference.ok and cached.ok and not reference_unusable(v, reference):
        compare_outputs(v, reference, cached, tolerance)
    v.details.append(f"note: {UNPROVEN}")
    v.details += [f"note: {n}" for n in served.notes]
    return v


def observed_fields(candidate_digest: str, daemon_digest: str, key_fields: tuple[str, ...]) -> tuple[str, ...]:
    """The key fields in which the engine's key differs from the daemon's, as
    observed: ``content_digest`` when the two digests differ, then the fields
    the product's key rule finds changed between the settings.

    >>> observed_fields("a" * 64, "a" * 64, ())
    ()
    >>> observed_fields("a" * 64, "b" * 64, ("dtype",))
    ('content_digest', 'dtype')
    """
    content = ("content_digest",) if candidate_digest != daemon_digest else ()
    return content + tuple(f for f in key_fields if f != "content_digest")


def judge_served(target: CacheTarget, case: GateCase, result: CaseResult, served: Served,
                 tolerance: float, mismatched_fields: tuple[str, ...] = (), is_moe: bool = False) -> Verdict:
    """The case's verdict. ``mismatched_fields``: the key fields the product's
    key rule finds changed between the cache's settings and the engine's
    (they make a hit wrong); ``is_moe``: vLLM's answer, which decides whether
    DP ranks number the daemon's ranks."""
    assert result.reference is not None and result.cached is not None
    if not target.records_events:
        return judge_output_only(result.reference, result.cached, served, tolerance)
    # A target that records events and recorded none served without saying
    # so: judge() blocks that as silent_fallback, never judged on output alone.
    # The required outcome follows from the digests and keys observed, never
    # from the case's name or the catalogue's reading of it (issue 37: a
    # switch onto a byte-identical copy of the base requires a hit).
    fields = observed_fields(result.candidate_digest, result.daemon_digest, mismatched_fields)
    outcome = expected_outcome(result.candidate_digest, result.daemon_digest, fields)
    exp = Expectation(outcome=outcome, candidate_digest=result.candidate_digest,
                      daemon_digest=result.daemon_digest, ranks=case.settings.tensor_parallel_size,
                      expected_fields=fields, dp_size=case.settings.data_parallel_size, is_moe=is_moe)
    v = judge(exp, result.reference, result.cached, tolerance)
    v.details += [f"note: {n}" for n in served.notes]
    return v
