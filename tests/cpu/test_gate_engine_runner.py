"""Engine runner failure paths: a hang and a crash are results, never a stuck harness."""

from __future__ import annotations

import time

import pytest

from harness.engine import EngineSpec, run_engine

pytestmark = pytest.mark.cpu


def test_hang_is_killed_at_the_deadline(tiny_ckpt, tmp_path):
    t0 = time.monotonic()
    r = run_engine(EngineSpec(checkpoint=str(tiny_ckpt)), tmp_path, timeout_s=2)
    assert time.monotonic() - t0 < 20  # 2 s deadline + bounded group kill
    assert not r.ok and r.timed_out and "timed out after 2 s" in r.error


def test_crash_is_a_result_with_its_log_tail(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    r = run_engine(EngineSpec(checkpoint=str(bad)), tmp_path / "run", timeout_s=240)
    assert not r.ok and not r.timed_out
    assert r.error and r.log_tail and r.token_ids == []
