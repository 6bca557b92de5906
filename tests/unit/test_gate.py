"""Gate logic without engines: case catalogue, key checks, exit codes, ipc_cache, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures.mutations import MUTATIONS
from harness.engine import EngineResult, EngineSpec
from harness.gate import (
    CaseResult,
    GateOptions,
    GateReport,
    GateSetupError,
    ReferenceCache,
    run_gate,
)
from harness.mutations import (
    CASES,
    CaseSelectionError,
    EngineSettings,
    GateCase,
    dense_key,
    select_cases,
)
from harness.verdict import BLOCK, NOT_RUN, PASS, Verdict
from preload.errors import CheckpointError

pytestmark = pytest.mark.unit
DIGEST = "d" * 64


def test_catalogue_extends_the_fixture_table_without_copying_it():
    names = [c.name for c in CASES]
    assert names[: len(MUTATIONS)] == [m.name for m in MUTATIONS]
    for case, row in zip(CASES, MUTATIONS, strict=False):
        assert case.recipe is row and case.weights_equal == row.weights_equal
    assert {"dtype_change", "tp_shift", "dp_shift"} <= set(names)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_required_outcome_follows_weights_and_settings(case: GateCase):
    equal_everything = case.weights_equal and case.settings == EngineSettings()
    assert case.expect == ("hit" if equal_everything else "miss")


@pytest.mark.parametrize("name,field", [("dtype_change", "dtype"), ("tp_shift", "tp_size"), ("dp_shift", "dp_size")])
def test_setting_cases_key_check_names_the_field(name, field):
    (case,) = select_cases(name)
    check = case.key_check(DIGEST)
    assert field in check.mismatched_fields and check.ok


def test_key_check_fails_when_settings_do_not_change_the_key():
    # Control: a "shift" that changes nothing must not pass the key check.
    fake = GateCase("no_shift", "", recipe=None, weights_equal=True, expected_fields=("dtype",))
    assert not fake.key_check(DIGEST).ok
    # and a dense model keys DP as (1, 0): DP alone does not change its key.
    assert dense_key(DIGEST, EngineSettings(data_parallel_size=2)) == dense_key(DIGEST, EngineSettings())


def test_select_cases_rejects_unknown_names():
    assert [c.name for c in select_cases("zeroed_norm, tail_edit")] == ["zeroed_norm", "tail_edit"]
    with pytest.raises(CaseSelectionError, match="unknown mutation nope"):
        select_cases("zeroed_norm,nope")


def _case(status: str) -> CaseResult:
    v = None if status == NOT_RUN else Verdict(status, ["output_mismatch"] if status == BLOCK else [])
    return CaseResult("c", "", "hit", True, {}, status, verdict=v, not_run_reason="x" if status == NOT_RUN else "")


@pytest.mark.parametrize(
    "statuses,verdict,code",
    [
        ([PASS, PASS], PASS, 0),
        ([PASS, NOT_RUN], PASS, 0),  # not run is listed, the cases that ran decide
        ([PASS, BLOCK, NOT_RUN], BLOCK, 1),
        ([NOT_RUN, NOT_RUN], NOT_RUN, 2),  # nothing ran: never a pass
        ([], NOT_RUN, 2),
    ],
)
def test_exit_codes(statuses, verdict, code):
    r = GateReport("self-test", "verified_cache", "c", "b", [_case(s) for s in statuses], {}, 1e-3, None)
    assert (r.verdict, r.exit_code) == (verdict, code)
    assert r.counts[PASS] == statuses.count(PASS)


def test_error_with_passes_is_not_a_pass():
    r = GateReport("self-test", "verified_cache", "c", "b", [_case(PASS)], {}, 1e-3, None, error="daemon died")
    assert r.exit_code == 2


def test_ipc_cache_on_cpu_runs_nothing_and_exits_2(tiny_ckpt):
    report = run_gate(GateOptions(candidate=str(tiny_ckpt), mutations="all", target="ipc_cache"))
    assert report.exit_code == 2 and report.verdict == NOT_RUN
    assert len(report.cases) == len(CASES)
    assert all(c.status == NOT_RUN and "CUDA" in c.not_run_reason for c in report.cases)


def test_cli_ipc_cache_exit_2_and_json(tiny_ckpt, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "preload_gate", "gate", str(tiny_ckpt), "--mutations", "zeroed_norm",
         "--target", "ipc_cache", "--json", "--report", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["counts"] == {"PASS": 0, "BLOCK": 0, "NOT_RUN": 1}
    assert {p.name for p in (tmp_path / "r").iterdir()} >= {"report.json", "report.md", "report.xml", "report.html"}


@pytest.mark.parametrize("argv,needle", [
    (["gate", "/nonexistent/ckpt", "--mutations", "all"], "does not exist"),
    (["gate", "{tiny}", "--mutations", "bogus"], "unknown mutation bogus"),
])
def test_cli_bad_input_is_one_line_exit_2(tiny_ckpt, argv, needle):
    argv = [a.replace("{tiny}", str(tiny_ckpt)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "preload_gate", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("preload-gate gate: error:")]
    assert len(err) == 1 and needle in err[0], proc.stderr


def test_missing_checkpoint_raises_before_any_work(tmp_path):
    with pytest.raises(CheckpointError):
        run_gate(GateOptions(candidate=str(tmp_path / "nope"), mutations="all"))
    with pytest.raises(GateSetupError):
        run_gate(GateOptions(candidate=str(tmp_path), target="tensorrt"))


def test_reference_cache_keys_on_digest_settings_version_and_skips_failures(tmp_path):
    cache = ReferenceCache(tmp_path)
    spec = EngineSpec(checkpoint="/a")
    k = cache.key(DIGEST, spec, "0.32.0")
    # Where the checkpoint lives does not matter; its bytes, settings and vLLM do.
    assert k == cache.key(DIGEST, EngineSpec(checkpoint="/elsewhere"), "0.32.0")
    assert k != cache.key("e" * 64, spec, "0.32.0")
    assert k != cache.key(DIGEST, EngineSpec(checkpoint="/a", dtype="float32"), "0.32.0")
    assert k != cache.key(DIGEST, spec, "0.33.0")
    cache.put(k, EngineResult(ok=False, error="boom"))
    assert cache.get(k) is None
    cache.put(k, EngineResult(ok=True, token_ids=[[1, 2]]))
    assert cache.get(k).token_ids == [[1, 2]]
