"""The events file is held to the trust rule (preload.trust): engines append
to it, the gate and ``canary check --events-file`` believe it. A symlink (any
owner), anything but a regular file, or a file of another uid at the path is
refused, by the writer with one warning line and the load unaffected, by the
readers with an error naming the path. Each hostile row has a control: a
plain new path and an existing file of ours still get the line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability_support import NOBODY, skip_privileged

from canaries.claims import from_events_file
from canaries.errors import GoldenError
from harness.engine import EngineSpec, run_engine
from preload.events import LoadEvent, emit, read_events
from preload.trust import UntrustedPathError

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
DIGEST = "b" * 64
VICTIM_TEXT = "the victim's own bytes\n"


class _Hung(Exception):
    """The open blocked: a FIFO with no peer held the load up."""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """Fail, do not hang, where an open waits on a FIFO (the old code did)."""
    def hung(_signum: int, _frame: object) -> None:
        raise _Hung("the events file open blocked for 5 s")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _hit() -> LoadEvent:
    return LoadEvent(outcome="hit", reason="daemon served the key", digest=DIGEST, daemon_digest=DIGEST,
                     source="daemon")


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _symlink_to_victim(tmp_path: Path, path: Path) -> Path:
    victim = _victim(tmp_path)
    path.symlink_to(victim)
    return victim


def _fifo(tmp_path: Path, path: Path) -> None:
    os.mkfifo(path)


def _directory(tmp_path: Path, path: Path) -> None:
    path.mkdir()


def _foreign(tmp_path: Path, path: Path) -> Path:
    if os.geteuid() != 0:
        skip_privileged("chown to another uid needs root")
    path.write_text(VICTIM_TEXT)
    os.chown(path, NOBODY, NOBODY)
    return path


# One row per way the path can be other than a file of ours: what is planted,
# the words the refusal must carry.
HOSTILE: dict[str, tuple[Callable[[Path, Path], object], str]] = {
    "symlink-to-victim": (_symlink_to_victim, "refusing symlinked events file"),
    "fifo": (_fifo, "is not a regular file"),
    "directory": (_directory, "is not a regular file"),
    "other-owner": (_foreign, f"is owned by uid {NOBODY}"),
}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("row", sorted(HOSTILE))
def test_emit_refuses_a_hostile_events_file_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, row: str) -> None:
    plant, words = HOSTILE[row]
    path = tmp_path / "ev.jsonl"
    victim = plant(tmp_path, path)
    caplog.set_level(logging.INFO)
    assert emit(_hit(), str(path), loud=False) is False  # refused, and emit did not raise
    if isinstance(victim, Path):
        assert victim.read_text() == VICTIM_TEXT  # nothing appended through the link / to their file
    (warning,) = _warnings(caplog)
    assert str(path) in warning and words in warning and "the load itself is unaffected" in warning
    # The load line is still logged: the refusal costs the file its line, nothing else.
    assert any(r.getMessage().startswith("preload-gate load:") for r in caplog.records)


@pytest.mark.parametrize("existing", [False, True], ids=["control-new-path", "control-own-0600-file"])
def test_emit_appends_to_a_file_of_ours(tmp_path: Path, caplog: pytest.LogCaptureFixture, existing: bool) -> None:
    path = tmp_path / "ev.jsonl"
    if existing:
        path.write_text('{"outcome": "miss"}\n')
        path.chmod(0o600)
    caplog.set_level(logging.INFO)
    assert emit(_hit(), str(path), loud=False) is True
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["daemon_digest"] == DIGEST and len(lines) == 1 + existing
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # created 0600, not world-readable
    assert _warnings(caplog) == []


def _own_symlink(tmp_path: Path, path: Path) -> None:
    """A symlink of ours to a file of ours holding a real event: still refused,
    as trust.py refuses every symlink where it is asked to trust."""
    real = tmp_path / "real.jsonl"
    assert emit(_hit(), str(real), loud=False)
    path.symlink_to(real)


READER_ROWS = {**HOSTILE, "own-symlink-to-own-file": (_own_symlink, "refusing symlinked events file")}


@pytest.mark.parametrize("row", sorted(READER_ROWS))
def test_readers_refuse_a_hostile_events_file(tmp_path: Path, row: str) -> None:
    plant, words = READER_ROWS[row]
    path = tmp_path / "ev.jsonl"
    plant(tmp_path, path)
    with pytest.raises(UntrustedPathError, match=words) as exc:
        read_events(path)
    assert str(path) in str(exc.value)
    with pytest.raises(GoldenError, match=words):  # canary check --events-file
        from_events_file(path)


def test_readers_read_a_file_of_ours(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    assert read_events(path) == []  # control: absent is no events
    assert emit(_hit(), str(path), loud=False)
    assert [e["outcome"] for e in read_events(path)] == ["hit"]
    assert from_events_file(path).digest == DIGEST


# A stand-in engine worker that leaves a symlink where the loader's events
# file goes, to a file holding a well-formed hit: the gate must not believe it.
SYMLINK_EVENTS_ENGINE = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    events = Path(os.environ["PRELOAD_GATE_EVENTS"])
    real = events.with_name("elsewhere.jsonl")
    real.write_text(json.dumps({"outcome": "hit", "reason": "x", "digest": "b" * 64,
                                "daemon_digest": "b" * 64, "rank": 0, "source": "daemon"}) + "\\n")
    events.symlink_to(real)
    Path(sys.argv[2]).write_text(json.dumps({"ok": True, "token_ids": [[5]], "texts": ["x"],
                                             "logprobs": [[{"5": -0.5}]]}))
""")


def test_engine_runner_fails_a_run_whose_events_file_is_a_symlink(tiny_ckpt: Path, tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "symlink_events_engine.py").write_text(SYMLINK_EVENTS_ENGINE)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(mods)])}
    signal.alarm(120)  # a real subprocess: more than the 5 s an open gets
    result = run_engine(EngineSpec(checkpoint=str(tiny_ckpt), env=env), tmp_path / "engine", timeout_s=100,
                        worker="symlink_events_engine")
    assert not result.ok and result.events == []
    assert "load events not read" in str(result.error) and "refusing symlinked events file" in str(result.error)
