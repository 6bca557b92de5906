"""Gate verdicts: PASS, or BLOCK with the reasons a person acts on.

One case compares a cached engine on the candidate (a daemon holds the
base) with an ``auto`` engine on the candidate. The reasons, as DESIGN
lists them:

- ``output_mismatch``: greedy token ids differ.
- ``logprob_drift``: tokens agree, the chosen tokens' logprobs differ by
  more than the stated tolerance.
- ``wrong_hit``: a ``hit`` on content other than the candidate's, judged
  against a digest the gate computed itself (never the loader's word): the
  event's digest or daemon digest differs from the independent hash of the
  candidate, or the daemon holds other content than the candidate; also a
  hit where the case requires a miss (settings changed).
- ``silent_fallback``: the engine served without any recorded load event
  (it loaded from somewhere without saying so), or it served after a miss
  where a hit was required.
- ``unexpected_miss``: a miss where a hit was required.
- ``error``: an engine failed, or its events break the contract (not one
  per rank, unknown outcome).
- ``candidate_unusable``: the cached engine's answers carry no usable
  numbers (NaN or +inf logprobs, a chosen token at -inf, logprobs missing)
  where the ``auto`` reference's are usable.

``NOT_RUN`` is not a pass: a case the platform cannot run says so and why.
A case whose engines ran is NOT_RUN with ``reference_unusable`` when the
``auto`` reference itself gave no usable answers (NaN or +inf logprobs, no
tokens, missing logprobs: e.g. an fp8 ``quantization_config`` on a bf16
checkpoint, on CPU): its outputs cannot judge anything, so the cache is
neither passed nor blamed by them. What the load events show against the
gate's own digests (a wrong hit, a silent fallback) still blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.engine import EngineResult

PASS, BLOCK, NOT_RUN = "PASS", "BLOCK", "NOT_RUN"
REASONS = (
    "output_mismatch",
    "logprob_drift",
    "wrong_hit",
    "silent_fallback",
    "unexpected_miss",
    "error",
    "candidate_unusable",
)
# Why a case whose engines ran is still NOT_RUN (nothing could be judged).
NOT_RUN_REASONS = ("reference_unusable",)
# Max |logprob(cached) - logprob(auto)| of a chosen token, in nats. Same
# weights on the same kernels give bitwise equal logits; the slack only
# absorbs a reduction order that differs between two engine starts.
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Expectation:
    """What the cached engine must do in one case."""

    outcome: str  # "hit" (required) or "miss" (a loud miss, then a disk load)
    candidate_digest: str  # independent content hash of the candidate
    daemon_digest: str  # independent content hash of what the daemon was started on
    ranks: int = 1
    expected_fields: tuple[str, ...] = ()
    dp_size: int = 1
    # MoE: DP ranks shard the experts and number the daemon's ranks; dense:
    # each DP replica loads as DP rank 0 of its own (vLLM resets it).
    is_moe: bool = False


@dataclass
class Verdict:
    status: str
    reasons: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    outcome: str | None = None  # the load outcome the events recorded
    first_difference: dict[str, Any] | None = None
    max_logprob_diff: float | None = None

    @property
    def blocked(self) -> bool:
        return self.status == BLOCK

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def _block(self, reason: str, detail: str) -> None:
        self.status = BLOCK
        if reason not in self.reasons:
            self.reasons.append(reason)
        self.details.append(f"{reason}: {detail}")


def expected_outcome(candidate_digest: str, daemon_digest: str, mismatched_fields: Sequence[str] = ()) -> str:
    """What a correct cache must do, from facts the gate computed itself:
    ``hit`` when the candidate's content digest is the daemon's and the
    engine's key equals the daemon's (by the product's own key rule);
    ``miss`` otherwise. A case's name never enters into it, so a base that is
    a byte-identical copy of the candidate (or itself) requires a hit.

    >>> expected_outcome("a" * 64, "a" * 64)
    'hit'
    >>> expected_outcome("a" * 64, "a" * 64, ["tp_size"])
    'miss'
    """
    return "hit" if candidate_digest == daemon_digest and not mismatched_fields else "miss"


def first_difference(
    a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]
) -> dict[str, Any] | None:
    """The first (prompt, position) where two greedy runs differ, or None.

    A missing prompt or a shorter run differs at its end (token None).
    """
    for p in range(max(len(a), len(b))):
        ta = list(a[p]) if p < len(a) else []
        tb = list(b[p]) if p < len(b) else []
        for i in range(max(len(ta), len(tb))):
            x = ta[i] if i < len(ta) else None
            y = tb[i] if i < len(tb) else None
            if x != y:
                return {"prompt": p, "position": i, "reference": x, "candidate": y}
    return None


def max_logprob_diff(reference: EngineResult, candidate: EngineResult) -> float:
    """Largest chosen-token logprob difference where both runs chose the same token."""
    worst = 0.0
    for p, (ref_ids, cand_ids) in enumerate(zip(reference.token_ids, candidate.token_ids, strict=False)):
        ref_lp = reference.logprobs[p] if p < len(reference.logprobs) else []
        cand_lp = candidate.logprobs[p] if p < len(candidate.logprobs) else []
        for i, (x, y) in enumerate(zip(ref_ids, cand_ids, strict=False)):
            if x != y or i >= len(ref_lp) or i >= len(cand_lp):
                break
            lx, ly = ref_lp[i].get(str(x)), cand_lp[i].get(str(y))
            if lx is None or ly is None:
                continue
            if math.isnan(lx) or math.isnan(ly):
                return math.inf
            worst = max(worst, abs(lx - ly))
    return worst


def unusable(result: EngineResult) -> str | None:
    """What makes a run's answers unusable for a comparison, in words; None
    when they are usable.

    Unusable: no prompt answered, a prompt with no tokens, a position
    without logprobs or without the chosen token's, a NaN or +inf logprob
    anywhere (a logprob is at most 0), or the chosen token at -inf (greedy
    picked a token of probability 0: the distribution is garbage).
    Non-finite positions are counted, the first named.
    """
    if not result.token_ids:
        return "it answered no prompt"
    bad: list[tuple[int, int, str]] = []
    positions = 0
    for p, ids in enumerate(result.token_ids):
        if not ids:
            return f"prompt {p}: no tokens"
        steps = result.logprobs[p] if p < len(result.logprobs) else []
        if len(steps) < len(ids):
            return f"prompt {p}: logprobs for {len(steps)} of its {len(ids)} tokens"
        for i, (tid, step) in enumerate(zip(ids, steps, strict=False)):
            positions += 1
            chosen = step.get(str(tid))
            if chosen is None:
                return f"prompt {p} position {i}: no logprob for the chosen token {tid}"
            values = [float(v) for v in step.values()]
            if any(math.isnan(v) for v in values):
                bad.append((p, i, "NaN"))
            elif any(v == math.inf for v in values):
                bad.append((p, i, "+inf"))
            elif chosen == -math.inf:
                bad.append((p, i, "-inf for the chosen token"))
    if not bad:
        return None
    kinds = sorted({k for *_, k in bad})
    p, i, _ = bad[0]
    return f"{'/'.join(kinds)} logprobs at {len(bad)} of {positions} positions (first: prompt {p} position {i})"


def expected_event_ranks(exp: Expectation) -> list[tuple[int, int]]:
    """The (dp rank, rank) of every load event a run must record: one per
    engine rank, on every DP replica."""
    out = []
    for dp in range(exp.dp_size):
        for r in range(exp.ranks):
            out.append((dp, (dp * exp.ranks + r) if exp.is_moe else r))
    return sorted(out)


def _check_events(v: Verdict, exp: Expectation, cand: EngineResult) -> None:
    events = cand.events
    outcomes = [e.get("outcome") for e in events]
    bad = [o for o in outcomes if o not in ("hit", "miss", "error")]
    if bad:
        v._block("error", f"load events with unknown outcome {bad}")
    ranks = sorted((int(e.get("dp_rank", 0) or 0), int(e.get("rank", 0) or 0)) for e in events)
    want = expected_event_ranks(exp)
    if events and ranks != want:
        v._block("error", f"expected one load event per (dp rank, rank) {want}, got {ranks}")
    if "hit" in outcomes:
        v.outcome = "hit"
    elif "miss" in outcomes:
        v.outcome = "miss"
    elif "error" in outcomes:
        v.outcome = "error"

    for e in events:
        if e.get("outcome") != "hit":
            continue
        # A header-keyed event's digest is not a content hash: it cannot be
        # compared with the candidate's content, and proves nothing either
        # way. What the daemon holds (its content was hashed as it loaded,
        # and the gate knows it) decides below for every event.
        content_claim = e.get("identity", "content") == "content"
        claimed = {k: e.get(k) for k in ("digest", "daemon_digest")} if content_claim else {}
        wrong = {k: d for k, d in claimed.items() if d != exp.candidate_digest}
        if not content_claim:
            v.details.append(f"note: rank {e.get('rank', 0)} hit under a {e.get('identity')} key: "
                             "judged by the content the daemon holds, not by the event's digest")
        if wrong:
            v._block(
                "wrong_hit",
                f"rank {e.get('rank', 0)} hit on "
                + ", ".join(f"{k}={str(d)[:16]}" for k, d in wrong.items())
                + f" but the candidate's content digest is {exp.candidate_digest[:16]}",
            )
        if exp.daemon_digest != exp.candidate_digest:
            v._block(
                "wrong_hit",
                f"rank {e.get('rank', 0)} hit while the daemon holds content "
                f"{exp.daemon_digest[:16]}, not the candidate's {exp.candidate_digest[:16]}",
            )
        elif exp.outcome == "miss":
            v._block(
                "wrong_hit",
                f"rank {e.get('rank', 0)} hit where a loud miss was required "
                f"(settings differ on {', '.join(exp.expected_fields) or 'the key'})",
            )

    if exp.outcome == "hit" and v.outcome in ("miss", "error"):
        reason = "; ".join(str(e.get("reason")) for e in events if e.get("outcome") != "hit")
        v._block("unexpected_miss", f"a hit was required, the load recorded: {reason}")
        if cand.ok:
            v._block("silent_fallback", "the engine served from disk where a hit was required")
    if exp.outcome == "miss" and v.outcome == "miss" and exp.expected_fields:
        named = {f for e in events for f in (e.get("fields") or [])}
        if named and not named & set(exp.expected_fields):
            v.details.append(
                f"note: the miss names {sorted(named)}, the case changed {list(exp.expected_fields)}"
            )


def judge(
    exp: Expectation,
    reference: EngineResult,
    candidate: EngineResult,
    tolerance: float = LOGPROB_TOLERANCE,
) -> Verdict:
    """Judge one case. Every applicable reason is listed, not only the first.

    A reference that ran but is :func:`unusable` compares nothing: the case
    is NOT_RUN (``reference_unusable``) unless the events alone block it.
    """
    v = Verdict(status=PASS)
    if not reference.ok:
        v._block("error", f"the auto reference engine failed: {reference.error}")
    _check_events(v, exp, candidate)
    if not candidate.ok:
        # A required hit that missed and refused to start (fallback off) is
        # already unexpected_miss; any other failure is an error.
        if not (exp.outcome == "hit" and v.outcome == "miss"):
            what = "with no load event" if not candidate.events else f"after a {v.outcome}"
            v._block("error", f"the cached engine failed {what}: {candidate.error}")
        return v
    if not candidate.events:
        v._block(
            "silent_fallback",
            "the cached engine served without recording any load event "
            "(loaded from disk without a miss)",
        )
    if not reference.ok:
        return v
    if reference_unusable(v, reference):
        return v
    compare_outputs(v, reference, candidate, tolerance)
    return v


def reference_unusable(v: Verdict, reference: EngineResult) -> bool:
    """True when ``reference`` is :func:`unusable`: ``v`` then says so, and
    is NOT_RUN unless something else already blocked it."""
    problem = unusable(reference)
    if problem is None:
        return False
    detail = (f"the auto reference on the candidate is unusable: {problem}; nothing was compared with it. "
              "The checkpoint gives auto engines no usable answers under these settings: run it with "
              "--load-format auto alone and fix what makes it so (e.g. a quantization_config that does not "
              "match the stored weights, or a dtype the model overflows in)")
    if v.status == BLOCK:
        v.details.append(f"note: outputs not compared: {detail}")
    else:
        v.status = NOT_RUN
        v.reasons.append("reference_unusable")
        v.details.append(f"reference_unusable: {detail}")
    return True


def compare_outputs(v: Verdict, reference: EngineResult, candidate: EngineResult, tolerance: float) -> None:
    """Tokens, then the candidate's usability, then logprobs, against a usable reference."""
    diff = first_difference(reference.token_ids, candidate.token_ids)
    if diff is not None:
        v.first_difference = diff
        v._block(
            "output_mismatch",
            f"prompt {diff['prompt']} position {diff['position']}: "
            f"auto {diff['reference']} vs cached {diff['candidate']}",
        )
    broken = unusable(candidate)
    if broken is not None:
        # A drift "of inf" would say nothing more: the numbers are gone.
        v._block("candidate_unusable", f"the cached engine's answers are unusable: {broken}, "
                                       "where the auto reference's are usable")
        return
    drift = max_logprob_diff(reference, candidate)
    v.max_logprob_diff = drift
    if drift > tolerance:
        v._block("logprob_drift", f"chosen-token logprob differs by {drift:.3g} > {tolerance:g}")
