"""``tox -e unit`` cannot silently run with vLLM (tests/tier_guard.py).

The env sets ``PRELOAD_GATE_UNIT_NO_VLLM=1``; here that env really lacks
vLLM, and a session in which vLLM is importable under that switch is refused
before collection. Controls: the same session without the switch runs, and
the guard answers None where vLLM is absent.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tier_guard import NO_VLLM_ENV, vllm_presence_problem

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_this_unit_env_has_no_vllm():
    if os.environ.get(NO_VLLM_ENV) != "1":
        pytest.skip(f"{NO_VLLM_ENV} is not set: not the tox unit env (tox -e unit sets it)")
    assert importlib.util.find_spec("vllm") is None


def test_guard_names_vllm_only_where_the_switch_says_none():
    found = SimpleNamespace(origin="/site-packages/vllm/__init__.py", submodule_search_locations=None)
    problem = vllm_presence_problem({NO_VLLM_ENV: "1"}, lambda name: found)
    assert problem and "/site-packages/vllm/__init__.py" in problem and "tox -r -e unit" in problem
    assert vllm_presence_problem({}, lambda name: found) is None  # other tiers may have vLLM
    assert vllm_presence_problem({NO_VLLM_ENV: "1"}, lambda name: None) is None


def test_a_session_with_vllm_under_the_switch_is_refused(tmp_path):
    """End to end: an importable ``vllm`` (a stand-in package on PYTHONPATH)
    under the switch ends the session with a usage error, nothing collected;
    control: the same session without the switch collects."""
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")

    def collect(switch: bool, n: int) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(fake))
        env.pop(NO_VLLM_ENV, None)
        if switch:
            env[NO_VLLM_ENV] = "1"
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "--collect-only", "-q",
             "--basetemp", str(tmp_path / f"bt{n}"), "tests/unit/test_tier_guard.py"],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=120)

    refused = collect(True, 0)
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert f"{NO_VLLM_ENV}=1" in refused.stderr and str(fake / "vllm") in refused.stderr
    control = collect(False, 1)
    assert control.returncode == 0, control.stdout + control.stderr
    assert "test_this_unit_env_has_no_vllm" in control.stdout
