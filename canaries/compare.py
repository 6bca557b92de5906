"""Comparing a replica's answer with the golden one: tokens exactly, logprobs within a tolerance.

Pure functions, no network, so the rules are unit-tested on their own.

Tokens are compared exactly: at temperature 0 the same weights on the same
vLLM give the same greedy tokens, and one differing token is what a wrong
cache looks like from outside. Logprobs are compared within an absolute
tolerance, because batching and kernel choice move the last bits of a
reduced-precision forward pass; a tolerance is a statement of how much, and
the result reports the largest difference seen so a reader can judge it.

Near-ties: at temperature 0 the greedy token is an argmax, and two tokens
whose logprobs sit within the last bits of precision can swap with batch
size or kernel choice on the very same weights (field case r05). Where the
replica's token differs from the golden's, and the golden recorded the
replica's token among its top logprobs within the tolerance of its own
choice (and the replica's logprob for it agrees within the tolerance), the
outcome is a *near-tie*, reported apart from a mismatch; the rest of that
prompt is not compared, since the two continuations diverge from there. A
token the golden ranked further away than the tolerance is a real
difference and fails, as before.

Top-k sets may legitimately differ at their boundary (two tokens tied for
k-th place can swap). A token present on one side only is accepted when its
logprob is within the tolerance of the other side's smallest top-k logprob
(a boundary tie); otherwise it is drift.

Gaps: a reply can lack what a judgement needs: a position with no logprobs
(vLLM writes ``null`` for both the token's logprob and its top logprobs when
it has none; a gateway may strip them or send ``[]``), fewer top logprobs
than asked, or an answer the server cut before the golden's length
(``finish_reason`` ``length`` or none, where only ``stop`` means the model
ended it). That is a :class:`Gap`, a refusal to judge, never drift: a
missing number is not a different number. A difference found elsewhere in
the same answers still wins, since it needs nothing the reply lacks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from canaries.golden import GoldenPrompt

# The OpenAI server clamps -inf to -9999 for JSON; clamp the golden side too.
LOGPROB_FLOOR = -9999.0
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class Answer:
    """A replica's answer to one prompt, as token ids and logprobs."""

    token_ids: list[int]
    # None where the reply has no logprob for that token (vLLM's null).
    token_logprobs: list[float | None]
    # None where the reply has no top logprobs for that position.
    top_logprobs: list[dict[int, float] | None]
    # The reply's finish_reason: "stop" (the model ended it), "length", or None.
    finish_reason: str | None = None


@dataclass(frozen=True)
class Difference:
    """Where a replica first departed from the golden.

    ``kind`` is ``token`` (a different greedy token; ``got_id`` is None when
    the answer ended early) or ``logprob`` (same tokens, a logprob beyond the
    tolerance; ``token_id`` names whose logprob).
    """

    kind: str
    prompt_index: int
    position: int
    expected_id: int | None = None
    got_id: int | None = None
    token_id: int | None = None
    expected_logprob: float | None = None
    got_logprob: float | None = None


@dataclass(frozen=True)
class NearTie:
    """A swap of two tokens the golden recorded within the tolerance of each other.

    ``gap`` is the golden's |logprob(expected) - logprob(got)|; ``compared``
    is how many tokens of the prompt were compared before it.
    """

    prompt_index: int
    position: int
    expected_id: int
    got_id: int
    gap: float
    # The golden itself recorded the two as tied: their gap is within one step
    # of the golden's own arithmetic (:func:`recording_grain`). Such a swap is
    # what the golden foresaw, not evidence against the weights, and is not
    # counted against a near-tie budget.
    recorded: bool = False

    @property
    def compared(self) -> int:
        return self.position


# The kinds of :class:`Gap`, each a reason a canary result carries.
NO_LOGPROBS = "no_logprobs"
SHORT_ANSWER = "short_answer"
GAP_KINDS = (NO_LOGPROBS, SHORT_ANSWER)


@dataclass(frozen=True)
class Gap:
    """Where a replica's answer lacks what a judgement needs: not a difference.

    ``kind`` is one of :data:`GAP_KINDS`: ``no_logprobs`` (at ``position``
    the reply has no logprob for the token, or no or fewer top logprobs than
    asked) or ``short_answer`` (the reply ends at ``position``, before the
    golden's length, and not because the model stopped); ``what`` says
    which, in the reply's own field names.
    """

    kind: str
    prompt_index: int
    position: int
    what: str


@dataclass(frozen=True)
class Comparison:
    difference: Difference | None
    # Largest |golden - replica| logprob over every token compared.
    max_delta: float
    near_ties: tuple[NearTie, ...] = ()
    # Set only when there is no difference: what the reply lacked.
    gap: Gap | None = None

    @property
    def ok(self) -> bool:
        return self.difference is None and self.gap is None


def _clamp(x: float) -> float:
    return max(x, LOGPROB_FLOOR) if not math.isnan(x) else x


def compare_answer(golden: GoldenPrompt, index: int, answer: Answer, tolerance: float,
                   top_k: int = 0) -> Comparison:
    """Compare one prompt's answer; the first token difference wins over any
    drift, unless it is a near-tie (then the positions before it are compared).

    ``top_k`` is how many top logprobs the request asked for: a position
    with fewer is a :class:`Gap`, as is any position without logprobs and an
    answer the server cut short; any difference in the compared positions
    wins over a gap.
    """
    expected, got = golden.token_ids, answer.token_ids
    first: int | None = None
    tie: NearTie | Gap | None = None
    for pos in range(max(len(expected), len(got))):
        e = expected[pos] if pos < len(expected) else None
        g = got[pos] if pos < len(got) else None
        if e != g:
            first = pos
            if g is None and answer.finish_reason != "stop":
                tie = Gap(SHORT_ANSWER, index, pos, f"{len(got)} tokens where the golden has {len(expected)} "
                          f"(finish_reason {answer.finish_reason!r}, not 'stop')")
                break
            tie = _near_tie(golden, index, pos, e, g, answer, tolerance)
            if tie is None:
                return Comparison(Difference("token", index, pos, expected_id=e, got_id=g), 0.0)
            break
    upto = len(expected) if first is None else first
    result = _compare_logprobs(golden, index, answer, tolerance, upto, top_k)
    if not result.ok or tie is None:
        return result
    if isinstance(tie, Gap):
        return Comparison(None, result.max_delta, gap=tie)
    return Comparison(None, result.max_delta, (tie,))


def _near_tie(golden: GoldenPrompt, index: int, pos: int, e: int | None, g: int | None, answer: Answer,
              tolerance: float) -> NearTie | Gap | None:
    """A near-tie at ``pos``, a gap (the golden ranks both tokens within the
    tolerance, and the reply has no logprob to tell a tie from a change), or
    None (then it is a real token difference)."""
    if e is None or g is None or pos >= len(golden.top_logprobs):
        return None
    step = golden.top_logprobs[pos]
    if str(g) not in step or str(e) not in step:
        return None  # the golden did not rank the replica's token close: a real difference
    gap = abs(_clamp(step[str(e)]) - _clamp(step[str(g)]))
    if math.isnan(gap) or gap > tolerance:
        return None
    got_lp = answer.token_logprobs[pos] if pos < len(answer.token_logprobs) else None
    if got_lp is None:
        return Gap(NO_LOGPROBS, index, pos, f"token_logprobs[{pos}] is null where the tokens swap")
    if math.isnan(got_lp) or abs(_clamp(got_lp) - _clamp(step[str(g)])) > tolerance:
        return None  # the same token at another probability: not numeric noise
    return NearTie(index, pos, e, g, gap)


def _compare_logprobs(golden: GoldenPrompt, index: int, answer: Answer, tolerance: float, upto: int,
                      top_k: int = 0) -> Comparison:
    """Logprobs of the first ``upto`` positions; the first difference, else
    the first gap (positions after a gap are still compared)."""
    expected = golden.token_ids[:upto]
    max_delta = 0.0
    gap: Gap | None = None
    for pos, tid in enumerate(expected):
        got_lp = answer.token_logprobs[pos] if pos < len(answer.token_logprobs) else None
        have = answer.top_logprobs[pos] if pos < len(answer.top_logprobs) else None
        missing = _missing(pos, got_lp, have, bool(golden.top_logprobs), top_k)
        if missing is not None:
            gap = gap or Gap(NO_LOGPROBS, index, pos, missing)
            continue
        assert got_lp is not None
        diff = _logprob_difference(index, pos, tid, golden.token_logprobs[pos], got_lp, tolerance)
        if isinstance(diff, Difference):
            return Comparison(diff, max(max_delta, _delta(diff)))
        max_delta = max(max_delta, diff)
        if golden.top_logprobs and have is not None:
            want = {int(k): v for k, v in golden.top_logprobs[pos].items()}
            result = _compare_top(index, pos, want, have, tolerance)
            if isinstance(result, Difference):
                return Comparison(result, max(max_delta, _delta(result)))
            max_delta = max(max_delta, result)
    return Comparison(None, max_delta, gap=gap)


def _missing(pos: int, got_lp: float | None, have: dict[int, float] | None, top_wanted: bool,
             top_k: int) -> str | None:
    """What the reply lacks at ``pos`` for a judgement, in its field names; None if nothing."""
    if got_lp is None:
        return f"token_logprobs[{pos}] is null or missing"
    if not top_wanted:
        return None
    if have is None:
        return f"top_logprobs[{pos}] is null or missing"
    if not have:
        return f"top_logprobs[{pos}] is empty"
    if len(have) < top_k:
        return f"top_logprobs[{pos}] has {len(have)} of the {top_k} asked"
    return None


def _delta(d: Difference) -> float:
    if d.expected_logprob is None or d.got_logprob is None:
        return math.inf
    return abs(_clamp(d.expected_logprob) - _clamp(d.got_logprob))


def _logprob_difference(
    index: int, pos: int, tid: int, expected: float, got: float, tolerance: float
) -> Difference | float:
    if math.isnan(got) or math.isnan(expected):
        return Difference("logprob", index, pos, token_id=tid, expected_logprob=expected, got_logprob=got)
    delta = abs(_clamp(expected) - _clamp(got))
    if delta > tolerance:
        return Difference("logprob", index, pos, token_id=tid, expected_logprob=expected, got_logprob=got)
    return delta


def _compare_top(
    index: int, pos: int, want: dict[int, float], have: dict[int, float], tolerance: float
) -> Difference | float:
    if not want:
        return 0.0
    max_delta = 0.0
    for tid in sorted(set(want) & set(have)):
        r = _logprob_difference(index, pos, tid, want[tid], have[tid], tolerance)
        if isinstance(r, Difference):
            return r
        max_delta = max(max_delta, r)
    # A token on one side only: fine if it sits at the other side's boundary.
    for only, other, missing_side in ((set(want) - set(have), have, "got"), (set(have) - set(want), want, "expected")):
        if not only:
            continue
        floor = min(_clamp(v) for v in other.values())
        for tid in sorted(only):
            value = _clamp(want[tid] if missing_side == "got" else have[tid])
            if value > floor + tolerance:
                return Difference(
                    "logprob", index, pos, token_id=tid,
                    expected_logprob=want.get(tid), got_logprob=have.get(tid),
                )
    return max_delta


def recording_grain(golden_prompts: Sequence[GoldenPrompt]) -> float:
    """The step of the golden's own arithmetic: the smallest non-zero
    difference between two logprobs it recorded at one position, where that
    is a power of two (logits in bf16 or fp16 differ by whole steps of their
    format: 2**-7 nats for logits between 1 and 2 in bf16); 0.0 otherwise
    (a float32 golden: only equal logprobs are a tie it recorded).

    Two tokens the golden recorded no more than one step apart are tied by
    its own numbers: which one greedy picks is the kernels' order, not the
    weights.

    >>> recording_grain([GoldenPrompt("p", [1], [5], "", [-0.5], [{"5": -0.5, "6": -0.5078125, "7": -1.0}])])
    0.0078125
    >>> recording_grain([GoldenPrompt("p", [1], [5], "", [-0.5], [{"5": -0.5, "6": -0.5001, "7": -1.0}])])
    0.0
    """
    steps = [abs(a - b) for g in golden_prompts for top in g.top_logprobs
             for a in map(_clamp, top.values()) for b in map(_clamp, top.values()) if a != b]
    step = min((x for x in steps if x > 0 and math.isfinite(x)), default=0.0)
    if step <= 0:
        return 0.0
    exponent = math.log2(step)
    return step if abs(exponent - round(exponent)) < 1e-3 else 0.0


def compare_answers(
    golden_prompts: Sequence[GoldenPrompt], answers: Sequence[Answer], tolerance: float, top_k: int = 0
) -> Comparison:
    """All prompts of one replica: the first difference in prompt order (over
    any gap, in any prompt), else the first gap, and the largest drift.
    Each near-tie says whether the golden recorded it as a tie
    (``NearTie.recorded``: its gap within :func:`recording_grain`)."""
    if len(answers) != len(golden_prompts):
        raise ValueError(f"{len(answers)} answers for {len(golden_prompts)} prompts")
    max_delta = 0.0
    ties: list[NearTie] = []
    gap: Gap | None = None
    for i, (g, a) in enumerate(zip(golden_prompts, answers, strict=True)):
        c = compare_answer(g, i, a, tolerance, top_k)
        if c.difference is not None:
            return Comparison(c.difference, max(max_delta, c.max_delta), tuple(ties))
        max_delta = max(max_delta, c.max_delta)
        ties.extend(c.near_ties)
        gap = gap or c.gap
    if ties:
        grain = recording_grain(golden_prompts)
        ties = [replace(t, recorded=t.gap <= grain) for t in ties]
    return Comparison(None, max_delta, tuple(ties), gap)
