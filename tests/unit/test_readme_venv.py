"""The README tells a new user to activate ``.venv`` before the first
``preload-gate`` command it shows (issue 39: the command was not found).
The control is the README before the fix (from git): the check fails on it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _activation_comes_first(text: str) -> bool:
    activate = text.find("source .venv/bin/activate")
    return activate != -1 and activate < text.find("preload-gate promote")


def test_the_readme_activates_the_venv_before_using_it() -> None:
    assert _activation_comes_first((REPO / "README.md").read_text())


def test_control_the_readme_before_the_fix_fails_the_check() -> None:
    old = subprocess.run(["git", "show", "3a0a346:README.md"], cwd=REPO, capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip(f"no git history here: {old.stderr.strip()}")
    assert not _activation_comes_first(old.stdout)
