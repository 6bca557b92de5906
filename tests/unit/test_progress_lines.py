"""Long verbs say how far they are where no terminal shows a bar (issue 39).

- ``promote``: plain ``promote: ...`` lines on stderr once it has hashed for
  QUIET_S (the held first line, one per shard done at most every 2 s, the
  last); a quick promote adds none; the
  control puts the old rule back (no lines off a terminal): nothing is said.
- ``canary record``: a line when the engine starts, every PROGRESS_S while it
  runs and when it is done (a real child process standing in for the
  engine); the control's plain ``wait`` says nothing. The verb prints them
  on stderr as ``canary record: ...``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import fresh_checkpoint

import preload.cli as promote_cli
from canaries import golden
from canaries.errors import GoldenError
from preload_gate.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_promote_says_how_far_it_is(tmp_path: Path, monkeypatch, capsys, fixed: bool) -> None:
    ckpt = fresh_checkpoint(tmp_path / "m", seed=1, shards=2)
    monkeypatch.setattr(promote_cli, "QUIET_S", 0.0)  # as if the hash had run long
    if not fixed:
        monkeypatch.setattr(promote_cli, "_progress", lambda: None)
    rc = main(["promote", str(ckpt), "--socket-root", str(tmp_path / "root"), "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 0
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    lines = [x for x in err.splitlines() if x.startswith("promote: ")]
    if not fixed:
        assert lines == []
        return
    assert lines[0].startswith(f"promote: sha256 of 2 shards, {size} bytes, ")
    assert lines[-1] == f"promote: hashed 2/2 shards, {size} of {size} bytes (100%)"


def test_a_quick_promote_adds_no_lines(tmp_path: Path, capsys) -> None:
    """Under QUIET_S a promote says nothing extra, so a refusal stays one line
    (the control is the test above, with the quiet period at 0)."""
    ckpt = fresh_checkpoint(tmp_path / "m", seed=1, shards=2)
    rc = main(["promote", str(ckpt), "--socket-root", str(tmp_path / "root"), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    assert [x for x in capsys.readouterr().err.splitlines() if x.startswith("promote: ")] == []


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_the_recording_engine_is_reported_while_it_runs(tmp_path: Path, monkeypatch, fixed: bool) -> None:
    monkeypatch.setattr(golden, "PROGRESS_S", 0.1)
    said: list[str] = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    if fixed:
        rc = golden._wait_reporting(proc, 30.0, said.append, tmp_path / "engine.log")
    else:  # the old rule: one plain wait
        rc = proc.wait(timeout=30.0)
    assert rc == 0
    running = [x for x in said if x.startswith("engine running, ")]
    assert (len(running) >= 2) is fixed, said
    done = bool(said) and said[-1].startswith("engine done in ") and said[-1].endswith(" s (exit code 0)")
    assert done is fixed


def test_a_timeout_is_none_and_reported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(golden, "PROGRESS_S", 0.1)
    said: list[str] = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert golden._wait_reporting(proc, 0.35, said.append, tmp_path / "engine.log") is None
    finally:
        proc.kill()
        proc.wait()
    assert said and all(x.startswith("engine running, ") for x in said)


def test_canary_record_prints_the_lines_on_stderr(tmp_path: Path, monkeypatch, capsys) -> None:
    ckpt = fresh_checkpoint(tmp_path / "m", seed=1, shards=1)

    def record(*args, progress=None, **kw):
        progress("starting an auto engine on M")
        raise GoldenError("stopped by the test")

    monkeypatch.setattr(golden, "record", record)
    rc = main(["canary", "record", "--model", str(ckpt), "--out", str(tmp_path / "g.json")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "canary record: starting an auto engine on M" in err
