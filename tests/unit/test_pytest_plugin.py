"""The pytest plugin's explanation of a difference, and its registration (no engines)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.engine import EngineResult
from harness.pytest_plugin import explain_difference

pytestmark = pytest.mark.unit


def _run(tokens, events=()):
    return EngineResult(ok=True, token_ids=tokens, events=list(events))


def test_same_tokens_explain_nothing(tiny_ckpt):
    assert explain_difference(_run([[1, 2], [3]]), _run([[1, 2], [3]]), str(tiny_ckpt)) is None


def test_difference_names_prompt_position_and_decodes_both_tokens(tiny_ckpt):
    # The tiny fixture's tokenizer is byte-level: ids 256+ are specials, 72 is a byte token.
    ref, cand = _run([[1, 2], [70, 71, 72]]), _run([[1, 2], [70, 71, 73]], [{"outcome": "hit", "rank": 0}])
    msg = explain_difference(ref, cand, str(tiny_ckpt), ["first", "second prompt"])
    assert msg is not None
    lines = msg.splitlines()
    assert lines[0] == "greedy outputs differ for 'second prompt' at generated token 2:"
    assert lines[1].startswith("  reference: id 72 ") and lines[2].startswith("  candidate: id 73 ")
    assert "<id" not in lines[1]  # decoded with the checkpoint's tokenizer, not just ids
    assert "2 tokens agree before it: [70, 71]" in msg and '"outcome": "hit"' in msg


def test_shorter_output_and_failed_engine_are_explained():
    msg = explain_difference(_run([[1, 2, 3]]), _run([[1, 2]]))
    assert msg is not None and "<end of output>" in msg and "<id 3>" in msg
    failed = EngineResult(ok=False, error="EngineCore died", log_tail="Traceback ...")
    assert "candidate engine failed: EngineCore died" in explain_difference(_run([[1]]), failed)


def test_plugin_is_registered_and_skips_without_a_checkpoint(tmp_path):
    (tmp_path / "test_user.py").write_text(
        "def test_eq(cached_engine, auto_engine, assert_same_output):\n"
        "    assert_same_output(auto_engine, cached_engine)\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no checkpoint: pass --preload-gate-checkpoint" in proc.stdout


USER_TESTS = '''
import pytest
from harness.engine import EngineResult

@pytest.fixture(scope="session")
def preload_gate_checkpoint():
    return "{ckpt}"

def _run(events):
    return EngineResult(ok=True, token_ids=[[1, 2, 3]], events=events)

def test_silent_fallback(assert_same_output):
    assert_same_output(_run([]), _run([]))

def test_hit(assert_same_output):
    assert_same_output(_run([]), _run([{{"outcome": "hit", "rank": 0}}]))

def test_loud_miss(assert_same_output):
    assert_same_output(_run([]), _run([{{"outcome": "miss", "rank": 0, "reason": "no daemon"}}]))

def test_two_disk_engines(assert_same_output):
    assert_same_output(_run([]), _run([]), cached=False)
'''


def test_equivalence_assertion_fails_a_cached_engine_with_no_load_event(tmp_path, tiny_ckpt):
    """Same tokens, no load event: the silent fallback fails, naming itself.
    Controls: the same tokens with a hit event pass, and two disk engines
    compared with cached=False pass (so the failure is the missing event)."""
    (tmp_path / "test_user.py").write_text(USER_TESTS.format(ckpt=tiny_ckpt))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "-p", "no:randomly", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert "FAILED test_user.py::test_silent_fallback" in out, out
    assert "recorded no load event" in out and "silent fallback" in out, out
    assert "PASSED test_user.py::test_hit" in out, out
    assert "FAILED test_user.py::test_loud_miss" in out and "did not hit: no daemon" in out, out
    assert "PASSED test_user.py::test_two_disk_engines" in out, out
