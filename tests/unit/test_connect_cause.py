"""A failed connect to a daemon socket is worded by its real cause (pgbase.oscause.connect_cause).

A Python socket with a timeout connects non-blocking, and a non-blocking
connect to an AF_UNIX listener whose backlog is full fails at once with
EAGAIN on Linux: the daemon is alive and busy (more engines connecting at
once than it has accepted yet), not absent. Worded "no daemon answers", an
operator starts a second daemon (refused by the rank lock) or gives up; a
start that believes the socket stale unlinks a live daemon's socket. So:

- the client retries EAGAIN for its connect timeout, as a blocking connect
  would wait, and then says the backlog is full (DaemonBusyError), never
  "no daemon";
- a liveness probe (``socket_answers``, the keeper's) counts a full
  backlog as alive;
- ECONNREFUSED (a socket file with nothing listening) and ENOENT stay "no
  daemon"; EACCES names the permission.

The listener here is real: backlog 0, never accepting, filled by
non-blocking connects until one gets EAGAIN. The control is the same socket
file with no listener behind it.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import FullListener, bind_private, short_dir

from pgbase import oscause
from pgbase.errors import WeightCacheUnavailableError
from preload.client import DaemonBusyError, DaemonClient
from preload.daemon.lock import RankBusyError, RankLock, socket_answers

pytestmark = pytest.mark.unit


@pytest.fixture
def sdir() -> Iterator[Path]:
    d = short_dir("pg-conn-")
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


@pytest.fixture
def full(sdir: Path) -> Iterator[FullListener]:
    f = FullListener(sdir / "rank0.sock")
    try:
        yield f
    finally:
        f.close()


def test_a_full_backlog_is_a_busy_daemon_not_no_daemon(sdir: Path, full: FullListener) -> None:
    t0 = time.monotonic()
    with pytest.raises(DaemonBusyError) as caught:
        DaemonClient.connect(sdir, 0, timeout_s=0.4)
    took = time.monotonic() - t0
    line = str(caught.value)
    assert "listen backlog is full" in line and "busy" in line and "no daemon" not in line, line
    assert "\n" not in line and str(full.path) in line
    assert isinstance(caught.value, WeightCacheUnavailableError)  # callers that fall back still do
    # Retried for the connect timeout, as a blocking connect would have waited; not much longer.
    assert 0.35 <= took < 3.0, took


def test_control_no_listener_is_no_daemon(sdir: Path) -> None:
    dead = bind_private(sdir / "rank0.sock")
    dead.close()  # the socket file stays, nothing listens: ECONNREFUSED
    t0 = time.monotonic()
    with pytest.raises(WeightCacheUnavailableError) as caught:
        DaemonClient.connect(sdir, 0, timeout_s=5.0)
    assert not isinstance(caught.value, DaemonBusyError)
    assert str(caught.value).startswith(f"no daemon answers at {sdir / 'rank0.sock'}: "), caught.value
    assert "backlog" not in str(caught.value)
    assert time.monotonic() - t0 < 1.0, "a daemon that is gone is not waited for"


def test_a_backlog_that_drains_within_the_timeout_connects(sdir: Path, full: FullListener) -> None:
    """The retry's point: once the daemon accepts, the engine gets through
    (here the listener accepts and closes, so the hello finds it closed)."""

    def drain() -> None:
        time.sleep(0.3)
        full.listener.settimeout(5.0)
        for _ in range(len(full.held) + 1):
            conn, _ = full.listener.accept()
            conn.close()

    t = threading.Thread(target=drain)
    t.start()
    try:
        with pytest.raises(WeightCacheUnavailableError) as caught:
            DaemonClient.connect(sdir, 0, timeout_s=5.0)
    finally:
        t.join(10)
    assert not isinstance(caught.value, DaemonBusyError), caught.value
    assert "closed the connection" in str(caught.value) or "dropped the connection" in str(caught.value)


def test_the_hf_attach_rank_says_busy_not_missing(sdir: Path, full: FullListener) -> None:
    from preload.hf_attach.ranks import RankMissError, connect_rank

    with pytest.raises(RankMissError) as caught:
        connect_rank(sdir, 0, 0, key=None)
    assert "listen backlog is full" in str(caught.value) and "no daemon" not in str(caught.value)
    full.close()  # control: the same socket, nothing listening
    with pytest.raises(RankMissError, match="no daemon for global rank 0"):
        connect_rank(sdir, 0, 0, key=None)


def test_a_busy_daemon_answers_for_liveness(sdir: Path, full: FullListener) -> None:
    """A start must not take a busy daemon's socket for stale (it would
    unlink it and bind its own): the socket answers, and the rank is busy."""
    from preload.daemon import keeper

    assert socket_answers(full.path, timeout_s=0.2)
    assert keeper._answers(full.path)
    with pytest.raises(RankBusyError, match="a live daemon answers"):
        RankLock.acquire(sdir, 0)


def test_control_a_dead_socket_does_not_answer(sdir: Path) -> None:
    from preload.daemon import keeper

    dead = bind_private(sdir / "rank0.sock")
    dead.close()
    assert not socket_answers(sdir / "rank0.sock")
    assert not keeper._answers(sdir / "rank0.sock")


# (id, exception, kind, words in the text, words not in it)
SHAPES = [
    ("EAGAIN: the listen backlog is full", BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"),
     oscause.BUSY, ["listen backlog is full", "busy"], ["no daemon", "nothing listens"]),
    ("a connect that timed out", TimeoutError("timed out"), oscause.BUSY, ["did not accept"], ["nothing listens"]),
    ("ECONNREFUSED: nothing listens", ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
     oscause.NO_LISTENER, ["nothing listens on"], ["busy"]),
    ("ENOENT: no socket file", FileNotFoundError(errno.ENOENT, "No such file or directory"), oscause.MISSING,
     ["does not exist"], ["busy"]),
    ("EACCES: no write permission on the socket", PermissionError(errno.EACCES, "Permission denied"),
     oscause.PERMISSION, ["Permission denied", "uid", "write permission"], ["no daemon", "busy"]),
    ("anything else keeps its errno's words", ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
     oscause.OTHER, ["Connection reset by peer"], []),
]


@pytest.mark.parametrize(("name", "exc", "kind", "words", "unwanted"), SHAPES, ids=[s[0] for s in SHAPES])
def test_connect_cause_by_shape(tmp_path: Path, name, exc, kind, words, unwanted) -> None:
    cause = oscause.connect_cause(exc, tmp_path / "rank0.sock")
    assert cause.kind == kind, cause
    for w in words:
        assert w in cause.text, (w, cause.text)
    for w in unwanted:
        assert w not in cause.text, (w, cause.text)


def test_every_connect_kind_has_a_row() -> None:
    assert {s[2] for s in SHAPES} == set(oscause.CONNECT_KINDS)
