"""The gate end to end on the tiny fixture: real daemon, real vLLM CPU engines.

Expensive (each engine start is 20-45 s on two cores), so the three runs
share one module-scoped ``auto`` reference cache: a reference computed for
one run is reused by the next (that reuse is itself part of the contract).

- the self-test passes, with hits where the weights and settings equal the
  base's and loud misses elsewhere;
- the header-only control (daemon and loader keyed like vLLM's upstream
  cache) BLOCKs: zeroed norm -> output_mismatch + wrong_hit; tail edit, a
  mid-tensor row and a single element -> wrong_hit even where tokens agree;
- the silent-fallback control BLOCKs as silent_fallback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.gate import GateOptions, run_gate
from harness.report import write_reports

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="gate")]


@pytest.fixture(scope="module")
def refcache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refcache")


def _gate(tiny_ckpt: Path, tmp: Path, refcache: Path, mutations: str, **kw):
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), mutations=mutations, workdir=str(tmp / "work"),
                                  reference_cache=str(refcache), **kw))
    write_reports(report.to_json(), tmp / "report")
    return report, {c.name: c for c in report.cases}


def test_self_test_passes_with_hits_and_loud_misses(tiny_ckpt, tmp_path, refcache):
    report, cases = _gate(tiny_ckpt, tmp_path, refcache, "identical_copy,zeroed_norm,single_element,dtype_change,dp_shift")
    assert report.exit_code == 0, [(c.name, c.verdict and c.verdict.details) for c in report.cases]
    assert cases["identical_copy"].verdict.outcome == "hit"
    for name in ("zeroed_norm", "single_element", "dtype_change"):
        v = cases[name].verdict
        assert v.outcome == "miss" and v.status == "PASS", (name, v.details)
        assert [e["outcome"] for e in cases[name].cached.events] == ["miss"]
    assert "dtype" in cases["dtype_change"].cached.events[0]["fields"]
    # The norm edit changes greedy tokens: the loud miss reloaded the right weights.
    assert cases["zeroed_norm"].reference.token_ids != cases["identical_copy"].reference.token_ids
    # dp_shift end to end through the OpenAI server at DP=2 against the DP=1
    # daemon: a dense model's replicas hold the full weights, so every DP
    # replica must hit (vLLM 0.32's own cache missed here, quietly).
    dp = cases["dp_shift"]
    assert dp.status == "PASS" and dp.expect == "hit" and dp.key_check["mismatched_fields"] == []
    assert sorted((e["dp_rank"], e["outcome"]) for e in dp.cached.events) == [(0, "hit"), (1, "hit")]
    assert (tmp_path / "report" / "report.html").stat().st_size > 0


def test_header_only_control_blocks_wrong_hits(tiny_ckpt, tmp_path, refcache):
    report, cases = _gate(tiny_ckpt, tmp_path, refcache, "zeroed_norm,tail_edit,mid_row_zeroed,single_element",
                          unsafe_identity="header_only")
    assert report.exit_code == 1
    assert {"output_mismatch", "wrong_hit"} <= set(cases["zeroed_norm"].verdict.reasons)
    for name in ("tail_edit", "mid_row_zeroed", "single_element"):
        v = cases[name].verdict
        assert v.outcome == "hit" and "wrong_hit" in v.reasons, (name, v.details)
    # "even where tokens agree": at least one small edit leaves greedy tokens unchanged,
    # and the gate blocks it anyway.
    agree = [n for n in ("mid_row_zeroed", "single_element") if "output_mismatch" not in cases[n].verdict.reasons]
    assert agree, "expected a small edit whose greedy tokens agree"


def test_silent_fallback_control_blocks(tiny_ckpt, tmp_path, refcache):
    report, cases = _gate(tiny_ckpt, tmp_path, refcache, "zeroed_norm", unsafe_silent_fallback=True)
    assert report.exit_code == 1
    v = cases["zeroed_norm"].verdict
    assert v.reasons == ["silent_fallback"] and cases["zeroed_norm"].cached.events == []
