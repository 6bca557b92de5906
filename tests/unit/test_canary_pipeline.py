"""ci/promote_pipeline.sh on bad input: one clear line, exit 2, no engine run.

The end-to-end run (promote, gate, golden, daemon, printed commands run
verbatim against a real server) is in tests/cpu/test_canary_serve.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "promote_pipeline.sh"


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    bindir = str(Path(sys.executable).parent)
    full_env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                    PRELOAD_GATE_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=full_env, cwd=tmp_path)


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if "error" in ln]


def test_missing_candidate_is_exit_2_one_line(tmp_path: Path) -> None:
    p = run(tmp_path, str(tmp_path / "absent"), "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    assert error_lines(p) == [f"promote_pipeline: error: candidate {tmp_path / 'absent'} is not a directory"]
    assert p.stdout == ""


def test_unknown_option_and_two_candidates_are_refused(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    p = run(tmp_path, str(tmp_path / "c"), "--frobnicate")
    assert p.returncode == 2 and "unknown option --frobnicate" in p.stderr
    p = run(tmp_path, str(tmp_path / "c"), str(tmp_path / "c"))
    assert p.returncode == 2 and "one candidate only" in p.stderr


def test_bad_checkpoint_stops_at_promote_before_any_engine(tmp_path: Path) -> None:
    ckpt = tmp_path / "bad"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    p = run(tmp_path, str(ckpt), "--out", str(tmp_path / "out"))
    assert p.returncode == 2, p.stderr
    assert "model.safetensors" in p.stderr  # promote names the shard
    assert "promote_pipeline: error: promote failed" in p.stderr
    assert "==> gate" not in p.stderr  # stopped before the gate
    assert not (tmp_path / "out").exists(), "a run that stopped before the gate leaves no --out folder it made"
    assert p.stdout == ""
    # An --out that existed before keeps what was there, and none of this run's files.
    given = tmp_path / "given"
    given.mkdir()
    (given / "mine.txt").write_text("x")
    p = run(tmp_path, str(ckpt), "--out", str(given))
    assert p.returncode == 2, p.stderr
    assert sorted(x.name for x in given.iterdir()) == ["mine.txt"]


def test_gate_that_cannot_run_is_exit_2_not_a_pass(tmp_path: Path, tiny_ckpt: Path) -> None:
    """A fake `preload-gate` whose gate verb exits 2 (could not run): the
    pipeline must stop with 2 and record nothing; and with exit 1, BLOCKED."""
    fake = tmp_path / "fake-pg"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = gate ]; then exit "$FAKE_GATE_RC"; fi\n'
        f'exec "{sys.executable}" -m preload_gate.cli "$@"\n'
    )
    fake.chmod(0o755)
    for rc, code, text in (("2", 2, "the gate could not run (exit 2)"), ("1", 1, "BLOCKED")):
        out = tmp_path / f"out{rc}"
        p = run(tmp_path, str(tiny_ckpt), "--out", str(out), "--socket-root", str(tmp_path / "s"),
                PRELOAD_GATE=str(fake), FAKE_GATE_RC=rc)
        assert p.returncode == code, p.stderr
        assert text in p.stderr
        assert (out / "promote.json").exists()
        assert not (out / "golden.json").exists() and not (out / "deploy.sh").exists()
        assert p.stdout == ""
