"""The gate's reference cache while another run computes a reference (new-user F9).

A run holding a key's lock (computing its ``auto`` engine, or hung) made
every other run asking for the same reference wait silently forever. The
waiter now says whom it waits for (the key, the checkpoint, the holder's pid
from the lock file, since when, how long it will wait) and says it again
periodically; the holder's line is counted, not timed. The wait is bounded
(four engine timeouts) and ends in a ReferenceWaitError naming the holder;
a holder that died while another process it left keeps the lock is named
with that process, not waited for. A lock file that is a directory or a
symlink was a raw OSError; it is one GateSetupError line naming the path
and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from harness.engine import EngineResult
from harness.gate import GateSetupError, ReferenceCache, references
from harness.gate.references import ReferenceWaitError

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
    first = threading.Thread(target=holder.reference, args=([key], slow), kwargs={"what": "/models/cand"})
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
    assert stage == "wait" and line.startswith(f"waiting for the reference of {key[:16]} (/models/cand) computed by "
                                               f"pid {os.getpid()} since ")
    assert "of at most 1200 s; if it is hung, stop it" in line  # 4 engine timeouts of 300 s
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


def _hold(lock, record: str | None = None) -> subprocess.Popen:
    """Another process holding ``lock``'s flock (as a hung gate run would),
    with ``record`` (default: its own pid, now) in the file; it holds until killed."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "rec = sys.argv[2] or f'{os.getpid()} {time.time():.0f} /models/hung'\n"
            "os.ftruncate(fd, 0); os.write(fd, rec.encode() + b'\\n')\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock), record or ""], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_hung_holder_ends_the_wait_in_a_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(references, "POLL_S", 0.02)
    notes = _Notes()
    cache = ReferenceCache(tmp_path / "refs", notes, engine_timeout_s=0.1)  # waits 4 x 0.1 s
    hung = _hold(cache._private_root() / "k.lock")
    try:
        t0 = time.monotonic()
        with pytest.raises(ReferenceWaitError) as caught:
            cache.reference(["k"], lambda: pytest.fail("computed while another run holds the lock"))
        assert time.monotonic() - t0 < BOUND_S
    finally:
        hung.kill()
        hung.wait()
    line = str(caught.value)
    assert line.startswith(f"waited 0 s for the reference of k (/models/hung) computed by pid {hung.pid} since "), line
    assert f"if it is hung, stop it (kill {hung.pid})" in line and "--reference-cache DIR" in line
    assert "\n" not in line
    assert notes.lines and notes.lines[0][1].startswith("waiting for the reference of k (/models/hung) computed by "
                                                         f"pid {hung.pid} since ")
    # Control: the holder gone (its flock with it), the same cache computes at once.
    assert cache.reference(["k"], lambda: EngineResult(ok=True, token_ids=[[5]]))[0].token_ids == [[5]]


@pytest.mark.parametrize("taker", ["dead", "alive"])
def test_a_dead_holder_is_named_with_who_kept_its_lock(tmp_path, monkeypatch, taker):
    """The pid in the lock file is gone, yet the flock is held: a process the
    dead run started kept the file open. Named at once, with that process.
    Control: the taker alive is waited for (here until it lets go)."""
    monkeypatch.setattr(references, "POLL_S", 0.02)
    monkeypatch.setattr(references, "DEAD_GRACE_S", 0.2)
    cache = ReferenceCache(tmp_path / "refs", _Notes())
    lock = cache._private_root() / "k.lock"
    record = f"{_dead_pid()} {time.time() - 60:.0f} /models/gone" if taker == "dead" else None
    keeper = _hold(lock, record)
    try:
        if taker == "alive":
            threading.Timer(1.0, keeper.kill).start()
            result, reused = cache.reference(["k"], lambda: EngineResult(ok=True, token_ids=[[9]]))
            assert not reused and result.token_ids == [[9]]
            return
        with pytest.raises(ReferenceWaitError) as caught:
            cache.reference(["k"], lambda: pytest.fail("computed while the lock is held"))
    finally:
        keeper.kill()
        keeper.wait()
    line = str(caught.value)
    dead = record.split()[0] if record else ""
    assert line.startswith("the lock on the reference of k (/models/gone) computed by pid "
                           f"{dead} since "), line
    assert f"is still held, but pid {dead} is gone: held by pid {keeper.pid}, which has the lock file open " \
           f"(stop: kill {keeper.pid}); then run again (lock file {lock})" in line
