"""gate_selftest times a self-test only when it passed: a BLOCKed self-test
(a case the gate got wrong, an engine that failed to start) is an error
naming the blocked cases, never a time in the table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import harness.gate
from harness.bench import BenchError, BenchOptions, run_rows

pytestmark = pytest.mark.unit


def _fake_gate(verdicts):
    def run_gate(opts):
        verdict = verdicts.pop(0)
        cases = [SimpleNamespace(name="zeroed_norm", status="PASS", cached=None, reference=None,
                                 reference_reused=False),
                 SimpleNamespace(name="dp_shift", status=verdict, cached=None, reference=None,
                                 reference_reused=False)]
        return SimpleNamespace(verdict=verdict, counts={verdict: 1}, cases=cases)
    return run_gate


def test_a_blocked_self_test_is_an_error_naming_its_cases(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.gate, "run_gate", _fake_gate(["BLOCK"]))
    with pytest.raises(BenchError, match=r"cold self-test's verdict is BLOCK \(blocked: dp_shift\)"):
        run_rows(BenchOptions(workdir=tmp_path, params={"mutations": "zeroed_norm"}), ["gate_selftest"])


def test_control_two_passing_runs_are_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.gate, "run_gate", _fake_gate(["PASS", "PASS"]))
    (r,) = run_rows(BenchOptions(workdir=tmp_path, params={"mutations": "zeroed_norm"}), ["gate_selftest"])
    assert [run["verdict"] for run in r.details["runs"]] == ["PASS", "PASS"]
    assert r.anchor.value > 0 and r.ours.value > 0
