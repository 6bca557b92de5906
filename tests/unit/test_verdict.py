"""The verdict logic as a table: each row is an engine pair and the verdict it must get.

Rows are recorded-shaped engine results (no vLLM). Every BLOCK reason has a
row that produces it and a neighbouring row, differing in the one thing the
reason is about, that does not: the control that the check can fail.
"""

from __future__ import annotations

import json
import math

import pytest

from harness.engine import EngineResult
from harness.verdict import (
    BLOCK,
    LOGPROB_TOLERANCE,
    NOT_RUN,
    PASS,
    Expectation,
    first_difference,
    judge,
    max_logprob_diff,
)

pytestmark = pytest.mark.unit

BASE = "a" * 64
OTHER = "b" * 64
HEADER = "c" * 64
TOKENS = [[5, 6, 7, 8], [9, 10, 11, 12]]


def _lp(tokens: list[list[int]], shift: float = 0.0) -> list[list[dict[str, float]]]:
    return [[{str(t): -0.5 - 0.01 * i + shift, "999": -3.0} for i, t in enumerate(row)] for row in tokens]


def engine(tokens=TOKENS, events=(), ok=True, shift=0.0, error=None) -> EngineResult:
    return EngineResult(ok=ok, token_ids=[list(r) for r in tokens] if ok else [],
                        logprobs=_lp(tokens, shift) if ok else [], events=[dict(e) for e in events],
                        error=error)


def hit(digest=BASE, daemon=BASE, rank=0) -> dict:
    return {"outcome": "hit", "reason": "daemon served the key", "fields": [], "digest": digest,
            "daemon_digest": daemon, "rank": rank}


def miss(digest=OTHER, fields=("content_digest",), rank=0) -> dict:
    return {"outcome": "miss", "reason": "no daemon for this digest", "fields": list(fields),
            "digest": digest, "daemon_digest": None, "rank": rank}


MUTATED = [[5, 6, 7, 8], [9, 10, 99, 12]]
REF = engine()
REF_MUT = engine(MUTATED)


def spoiled(result: EngineResult, value: float, prompt: int = 0, position: int = 1, chosen: bool = True) -> EngineResult:
    """``result`` with one logprob set to ``value`` (the chosen token's, or the runner-up's)."""
    out = EngineResult.from_json(json.loads(json.dumps(result.to_json())))
    key = str(out.token_ids[prompt][position]) if chosen else "999"
    out.logprobs[prompt][position][key] = value
    return out


def nan_everywhere(result: EngineResult) -> EngineResult:
    """What an auto engine on an fp8 quantization_config over bf16 weights gave on CPU: NaN at every position."""
    out = EngineResult.from_json(json.loads(json.dumps(result.to_json())))
    out.logprobs = [[{k: math.nan for k in step} for step in row] for row in out.logprobs]
    return out


def stripped(result: EngineResult, **fields) -> EngineResult:
    out = EngineResult.from_json(json.loads(json.dumps(result.to_json())))
    for k, v in fields.items():
        setattr(out, k, v)
    return out

# (id, expectation, reference, candidate, status, reasons)
TABLE = [
    ("hit equal tokens passes", Expectation("hit", BASE, BASE), REF, engine(events=[hit()]), PASS, []),
    ("loud miss on other content passes", Expectation("miss", OTHER, BASE), REF_MUT,
     engine(MUTATED, events=[miss()]), PASS, []),
    ("tokens differ -> output_mismatch", Expectation("hit", BASE, BASE), REF,
     engine(MUTATED, events=[hit()]), BLOCK, ["output_mismatch"]),
    ("logprob beyond tolerance -> drift", Expectation("hit", BASE, BASE), REF,
     engine(events=[hit()], shift=10 * LOGPROB_TOLERANCE), BLOCK, ["logprob_drift"]),
    ("logprob within tolerance passes", Expectation("hit", BASE, BASE), REF,
     engine(events=[hit()], shift=LOGPROB_TOLERANCE / 10), PASS, []),
    # The upstream bug: a header-keyed hit on other content, tokens differ.
    ("hit on base while candidate differs -> wrong_hit + mismatch", Expectation("miss", OTHER, BASE),
     REF_MUT, engine(TOKENS, events=[hit(HEADER, HEADER)]), BLOCK, ["wrong_hit", "output_mismatch"]),
    # ... and where the edit is too small to move a greedy token.
    ("wrong hit with equal tokens -> wrong_hit", Expectation("miss", OTHER, BASE), REF,
     engine(events=[hit(HEADER, HEADER)]), BLOCK, ["wrong_hit"]),
    ("hit whose claimed digest is not the candidate's -> wrong_hit", Expectation("hit", BASE, BASE), REF,
     engine(events=[hit(digest=OTHER, daemon=OTHER)]), BLOCK, ["wrong_hit"]),
    # A header-keyed hit (the unsafe control) on an identical copy served the
    # right bytes: the daemon holds the candidate's content. Its neighbour,
    # the same event while the daemon holds other content, is a wrong hit.
    ("header-keyed hit, daemon holds the candidate's content -> pass", Expectation("hit", BASE, BASE), REF,
     engine(events=[{**hit(HEADER, HEADER), "identity": "header_only"}]), PASS, []),
    ("header-keyed hit, daemon holds other content -> wrong_hit", Expectation("miss", OTHER, BASE), REF,
     engine(events=[{**hit(HEADER, HEADER), "identity": "header_only"}]), BLOCK, ["wrong_hit"]),
    ("hit where settings require a miss -> wrong_hit", Expectation("miss", BASE, BASE, expected_fields=("dtype",)),
     REF, engine(events=[hit()]), BLOCK, ["wrong_hit"]),
    ("served with no event -> silent_fallback", Expectation("miss", OTHER, BASE), REF_MUT,
     engine(MUTATED, events=[]), BLOCK, ["silent_fallback"]),
    ("required hit missed, engine refused -> unexpected_miss", Expectation("hit", BASE, BASE), REF,
     engine(ok=False, events=[miss(BASE, ["dtype"])], error="fallback off"), BLOCK, ["unexpected_miss"]),
    ("required hit missed, engine served from disk -> unexpected_miss + silent_fallback",
     Expectation("hit", BASE, BASE), REF, engine(events=[miss(BASE)]), BLOCK,
     ["unexpected_miss", "silent_fallback"]),
    ("cached engine crashed -> error", Expectation("miss", OTHER, BASE), REF_MUT,
     engine(ok=False, error="EngineCore died"), BLOCK, ["error"]),
    ("reference crashed -> error", Expectation("hit", BASE, BASE), engine(ok=False, error="boom"),
     engine(events=[hit()]), BLOCK, ["error"]),
    ("two events for one rank -> error", Expectation("hit", BASE, BASE), REF,
     engine(events=[hit(), hit()]), BLOCK, ["error"]),
    ("one event per rank at TP=2 passes", Expectation("hit", BASE, BASE, ranks=2), REF,
     engine(events=[hit(rank=0), hit(rank=1)]), PASS, []),
    ("unknown outcome -> error", Expectation("hit", BASE, BASE), REF,
     engine(events=[{"outcome": "maybe", "rank": 0}]), BLOCK, ["error"]),
    # An auto reference that ran but gave nothing usable judges nothing: never
    # PASS, never a BLOCK blaming the cache by outputs. Each row's neighbour
    # is the usable reference: "hit equal tokens passes", "tokens differ".
    ("reference NaN everywhere -> not run", Expectation("hit", BASE, BASE), nan_everywhere(REF),
     engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    ("reference NaN, cached tokens differ -> not run, not output_mismatch", Expectation("hit", BASE, BASE),
     nan_everywhere(REF), engine(MUTATED, events=[hit()]), NOT_RUN, ["reference_unusable"]),
    ("reference NaN at one runner-up -> not run", Expectation("hit", BASE, BASE),
     spoiled(REF, math.nan, chosen=False), engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    ("reference +inf -> not run", Expectation("hit", BASE, BASE), spoiled(REF, math.inf),
     engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    ("reference chose a -inf token -> not run", Expectation("hit", BASE, BASE), spoiled(REF, -math.inf),
     engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    # Control: a runner-up at -inf (probability 0) is a usable answer.
    ("reference runner-up at -inf passes", Expectation("hit", BASE, BASE),
     spoiled(REF, -math.inf, chosen=False), spoiled(engine(events=[hit()]), -math.inf, chosen=False), PASS, []),
    ("reference answered no prompt -> not run", Expectation("hit", BASE, BASE),
     stripped(REF, token_ids=[], logprobs=[]), engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    ("reference prompt with no tokens -> not run", Expectation("hit", BASE, BASE),
     stripped(REF, token_ids=[[5, 6, 7, 8], []], logprobs=REF.logprobs[:1] + [[]]), engine(events=[hit()]),
     NOT_RUN, ["reference_unusable"]),
    ("reference without logprobs -> not run", Expectation("hit", BASE, BASE), stripped(REF, logprobs=[]),
     engine(events=[hit()]), NOT_RUN, ["reference_unusable"]),
    # What the events show against the gate's own digests needs no reference.
    ("reference NaN, wrong hit -> wrong_hit", Expectation("miss", OTHER, BASE), nan_everywhere(REF),
     engine(events=[hit(HEADER, HEADER)]), BLOCK, ["wrong_hit"]),
    # The candidate broken where the reference is not: the cache is blamed.
    ("cached NaN, reference finite -> candidate_unusable", Expectation("hit", BASE, BASE), REF,
     nan_everywhere(engine(events=[hit()])), BLOCK, ["candidate_unusable"]),
    ("cached +inf at one position -> candidate_unusable", Expectation("hit", BASE, BASE), REF,
     spoiled(engine(events=[hit()]), math.inf, prompt=1, position=3), BLOCK, ["candidate_unusable"]),
    ("cached without logprobs -> candidate_unusable", Expectation("hit", BASE, BASE), REF,
     stripped(engine(events=[hit()]), logprobs=[]), BLOCK, ["candidate_unusable"]),
    ("cached NaN and tokens differ -> both", Expectation("hit", BASE, BASE), REF,
     nan_everywhere(engine(MUTATED, events=[hit()])), BLOCK, ["output_mismatch", "candidate_unusable"]),
    ("both NaN -> not run", Expectation("hit", BASE, BASE), nan_everywhere(REF),
     nan_everywhere(engine(events=[hit()])), NOT_RUN, ["reference_unusable"]),
]


@pytest.mark.parametrize("name,exp,ref,cand,status,reasons", TABLE, ids=[r[0] for r in TABLE])
def test_verdict_table(name, exp, ref, cand, status, reasons):
    v = judge(exp, ref, cand)
    assert v.status == status, v.details
    assert sorted(v.reasons) == sorted(reasons), v.details
    assert len(v.details) >= len(reasons)


def test_every_reason_is_produced_by_some_row():
    from harness.verdict import NOT_RUN_REASONS, REASONS

    seen = {r for *_, reasons in TABLE for r in reasons}
    assert seen == set(REASONS) | set(NOT_RUN_REASONS)


def test_reference_unusable_names_what_was_wrong_and_the_case_says_why_not_run():
    from harness.results import CaseResult
    from harness.targets.base import Served
    from harness.targets.judge import judge_output_only

    v = judge(Expectation("hit", BASE, BASE), nan_everywhere(REF), engine(MUTATED, events=[hit()]))
    (detail,) = v.details
    assert "NaN logprobs at 8 of 8 positions (first: prompt 0 position 0)" in detail
    assert "quantization_config" in detail and v.first_difference is None
    case = CaseResult("c", "d", "hit", True, {}, NOT_RUN)
    case.record(v)
    assert case.status == NOT_RUN and case.not_run_reason.startswith("reference_unusable: the auto reference")
    # A cache judged on output alone (npcache, sharded_state) meets the same rule.
    out = judge_output_only(nan_everywhere(REF), engine(MUTATED), Served(False), LOGPROB_TOLERANCE)
    assert (out.status, out.reasons) == (NOT_RUN, ["reference_unusable"])
    assert judge_output_only(REF, engine(MUTATED), Served(False), LOGPROB_TOLERANCE).reasons == ["output_mismatch"]


def test_first_difference_names_prompt_position_and_both_tokens():
    assert first_difference(TOKENS, TOKENS) is None
    assert first_difference(TOKENS, MUTATED) == {"prompt": 1, "position": 2, "reference": 11, "candidate": 99}
    # A shorter run differs where it stops.
    assert first_difference([[1, 2, 3]], [[1, 2]]) == {"prompt": 0, "position": 2, "reference": 3, "candidate": None}


def test_logprob_diff_only_where_tokens_agree_and_nan_is_infinite():
    assert max_logprob_diff(REF, engine(shift=0.25)) == pytest.approx(0.25)
    nan = engine()
    nan.logprobs[0][0][str(TOKENS[0][0])] = math.nan
    assert max_logprob_diff(REF, nan) == math.inf
