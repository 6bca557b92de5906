"""Lock files that are not files (``pgbase.lockfile``), for every lock that
takes one: the gate's reference cache (tests/unit/test_reference_wait.py),
a daemon rank's lock and the preflight probe of it.

A directory or a symlink at a lock's path was a raw OSError traceback
(IsADirectoryError, or ELOOP from O_NOFOLLOW); a directory passed the
preflight probe (a directory opens read-only and takes a flock) and then
failed the rank. Each is now one line naming the path, what it is and the
fix. One row per kind, a regular file as every row's passing neighbour.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

import pytest
from daemon_support import short_dir

from pgbase.errors import PreflightError
from pgbase.lockfile import (
    Holder,
    LockFileError,
    holder_gone,
    open_by,
    open_lock_file,
    read_holder,
    record_holder,
)
from preload.daemon.lock import RankBusyError, RankLock
from preload.preflight import check_rank_locks

pytestmark = pytest.mark.unit

KINDS = {"directory": "a directory", "symlink": "a symlink", "fifo": "not a regular file"}


def _plant(path, kind: str) -> None:
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(path.with_name("target"))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("")


@pytest.mark.parametrize("kind", [*KINDS, "file"])
@pytest.mark.parametrize("create", [True, False])
def test_open_lock_file_refuses_what_is_not_a_file(tmp_path, kind, create):
    path = tmp_path / "x.lock"
    _plant(path, kind)
    if kind == "file":  # the neighbour: a regular file is opened and locks
        fd = open_lock_file(path, "test lock", create=create)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        return
    with pytest.raises(LockFileError) as caught:
        open_lock_file(path, "test lock", create=create)
    assert str(caught.value) == (f"test lock {path} is {KINDS[kind]}, not a lock file; "
                                 f"remove it (rm -r {path}) and run again")
    assert not path.with_name("target").exists(), "nothing created through a symlink"


def test_a_missing_lock_file_is_created_or_reported_missing(tmp_path):
    path = tmp_path / "new.lock"
    with pytest.raises(FileNotFoundError):
        open_lock_file(path, "test lock", create=False)
    fd = open_lock_file(path, "test lock")
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert read_holder(fd) == ("unknown", None, "")
        record_holder(fd, "/models/a b\nc")
        pid, since, what = read_holder(fd)
        assert pid == str(os.getpid()) and since is not None and since > 0 and what == "/models/a b c"
        record_holder(fd)  # a shorter record replaces the longer one whole
        assert read_holder(fd).what == ""
    finally:
        os.close(fd)


def test_a_holder_that_no_longer_runs_is_gone():
    """A free pid, or a pid that now names a process started after the lock
    was taken (reused), is gone; this process, since after it started, is not."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert holder_gone(Holder(str(dead.pid), time.time()))
    assert not holder_gone(Holder(str(os.getpid()), time.time()))  # control: alive
    assert holder_gone(Holder(str(os.getpid()), 1_000_000.0)), "a lock taken in 1970 was not taken by this process"
    assert not holder_gone(Holder("unknown", None)), "nobody named is not known to be gone"


def test_open_by_names_the_processes_with_the_file_open(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("")
    keeper = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                               "time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert keeper.stdout is not None and keeper.stdout.readline()
        assert open_by(path) == [keeper.pid]
    finally:
        keeper.kill()
        keeper.wait()
    assert open_by(path) == []  # control: closed with its process


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_rank_lock_that_is_not_a_file_is_refused_by_name(kind):
    d = short_dir("pg-lk-")
    try:
        _plant(d / "rank0.lock", kind)
        with pytest.raises(PreflightError, match=f"rank 0 lock {d}/rank0.lock is {KINDS[kind]}, not a lock file"):
            check_rank_locks(d, [0])
        with pytest.raises(LockFileError, match=f"is {KINDS[kind]}, not a lock file"):
            RankLock.acquire(d, 0)
        # A held lock whose file was swapped for one: reclaim refuses it as busy (the home watch tolerates that).
        if kind == "directory":
            (d / "rank0.lock").rmdir()
        else:
            (d / "rank0.lock").unlink()
        lock = RankLock.acquire(d, 0)  # control: a path with nothing there is taken
        os.unlink(d / "rank0.lock")
        _plant(d / "rank0.lock", kind)
        with pytest.raises(RankBusyError, match="was replaced"):
            lock.reclaim()
        lock.release()
    finally:
        shutil.rmtree(d, ignore_errors=True)
