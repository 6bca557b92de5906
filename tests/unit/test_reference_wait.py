"""The gate's reference cache while another run computes a reference (new-user F9).

A run holding a key's lock (computing its ``auto`` engine, or hung) made
every other run asking for the same reference wait silently forever. The
waiter now says whom it waits for (the key, the holder's pid from the lock
file, since when) and says it again periodically; the holder's line is
counted, not timed. A lock file that is a directory or a symlink was a raw
OSError; it is one GateSetupError line naming the path and the fix.
"""

from __future__ import annotations

import os
import threading

import pytest

from harness.engine import EngineResult
from harness.gate import GateSetupError, ReferenceCache, references

pytestmark = pytest.mark.unit
BOUND_S = 60.0


class _Notes:
    """A progress callback that lets a test wait for the n-th line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.changed = threading.Condition()

    def __call__(self, stage: str, message: str) -> None:
        with self.changed:
            self.lines.append((stage, message))
            self.changed.notify_all()

    def wait_for(self, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.lines) >= n, BOUND_S)


def test_a_waiting_run_says_whom_it_waits_for_and_says_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr(references, "WAIT_NOTE_S", 0.0)  # every poll: counted, not timed
    holder_in, release = threading.Event(), threading.Event()

    def slow() -> EngineResult:
        holder_in.set()
        release.wait(BOUND_S)
        return EngineResult(ok=True, token_ids=[[1]])

    holder_notes, waiter_notes = _Notes(), _Notes()
    holder = ReferenceCache(tmp_path / "refs", holder_notes)
    waiter = ReferenceCache(tmp_path / "refs", waiter_notes)
    key = "ab" * 32
    first = threading.Thread(target=holder.reference, args=([key], slow))
    first.start()
    assert holder_in.wait(BOUND_S)
    out: list = []
    second = threading.Thread(target=lambda: out.append(waiter.reference([key], lambda: pytest.fail("computed twice"))))
    second.start()
    try:
        assert waiter_notes.wait_for(2), "the waiting run said nothing, or said it only once"
    finally:
        release.set()
        first.join(BOUND_S)
        second.join(BOUND_S)
    stage, line = waiter_notes.lines[0]
    assert stage == "wait" and line.startswith(f"waiting for the reference of {key[:16]} computed by pid {os.getpid()} since ")
    assert "unknown" not in line, "the holder recorded its pid and start time in the lock file"
    assert out[0][1] is True, "then it reused the holder's reference"
    # Control: a run that finds the key free waits for nobody and says nothing.
    assert holder_notes.lines == []
    assert (tmp_path / "refs" / f"{key}.lock").read_text().split()[0] == str(os.getpid())


def test_without_a_progress_channel_the_wait_goes_to_stderr(tmp_path, capsys, monkeypatch):
    """A --json gate run has no progress callback: the line still reaches a person."""
    import fcntl

    cache = ReferenceCache(tmp_path / "refs")
    lock = tmp_path / "refs" / "k.lock"
    cache._private_root()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242 1700000000\n")
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # the holder lets go once the waiter has looked twice
        sleeps.append(s)
        if len(sleeps) == 2:
            os.close(fd)

    monkeypatch.setattr(references.time, "sleep", sleep)
    result, reused = cache.reference(["k"], lambda: EngineResult(ok=True, token_ids=[[7]]))
    assert not reused and result.token_ids == [[7]]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("waiting for the reference of k computed by pid 4242 since ")


@pytest.mark.parametrize("plant", ["directory", "symlink"])
def test_a_lock_file_that_is_not_a_file_is_one_clear_refusal(tmp_path, plant):
    cache = ReferenceCache(tmp_path / "refs")
    lock = cache._private_root() / "k.lock"
    if plant == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(GateSetupError) as caught:
        cache.reference(["k"], lambda: pytest.fail("computed despite a broken lock"))
    message = str(caught.value)
    assert f"{lock} is a {plant}, not a lock file" in message and "remove it" in message
    assert "\n" not in message
    assert not (tmp_path / "elsewhere").exists(), "nothing was created through the symlink"
    # Control: a regular lock file (left by an earlier run) is used.
    other = ReferenceCache(tmp_path / "refs2")
    (other._private_root() / "k.lock").write_text("")
    assert other.reference(["k"], lambda: EngineResult(ok=True, token_ids=[[3]]))[0].token_ids == [[3]]
