"""A user's equivalence test through the plugin, on the tiny fixture: it passes
when the daemon serves the checkpoint, and fails, explained token by token,
when the test compares against another checkpoint's output."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="gate")]

USER_TESTS = '''
import pytest
from harness.engine import EngineSpec, run_engine

def test_cached_equals_auto(cached_engine, auto_engine, assert_same_output):
    assert [e["outcome"] for e in cached_engine.events] == ["hit"]
    assert_same_output(auto_engine, cached_engine)

def test_control_other_weights_differ(cached_engine, assert_same_output, tmp_path):
    # Control: auto on an edited copy of the checkpoint must not look equal.
    from fixtures.mutations import by_name
    import os
    other = by_name("zeroed_norm").apply(os.environ["PG_CKPT"], tmp_path)
    assert_same_output(run_engine(EngineSpec(checkpoint=str(other)), tmp_path / "auto-other"), cached_engine)
'''


def test_user_equivalence_test_passes_and_control_fails_with_explanation(tiny_ckpt, tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--preload-gate-checkpoint",
         str(tiny_ckpt), str(tmp_path / "test_user.py")],
        capture_output=True, text=True, timeout=580, cwd=tmp_path,
        env={**__import__("os").environ, "PG_CKPT": str(tiny_ckpt)},
    )
    out = proc.stdout
    assert "1 failed, 1 passed" in out, out[-4000:] + proc.stderr[-2000:]
    assert "greedy outputs differ for" in out and "reference: id" in out and "candidate: id" in out
