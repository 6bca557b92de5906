"""``get_state`` hammered against ``release`` and ``stop``: no bad descriptor,
no hang, counters that add up.

One in-process rank server per round (raw stage, a real sealed memfd arena),
several client threads asking for the state while another thread releases
or stops it. Every reply a client gets is either an error frame or an ok
frame whose descriptor is a live, sealed memfd of the arena's size. After
each round the server's served count equals the ok replies clients received
(counters move only after a successful send; a hit further waits for the
engine's report, preload.daemon.counters).

The control runs the same rounds against a server patched back to the old
shape (reading the arena's descriptors outside the lock, counting before
sending) and shows the check catching it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from reliability_support import fresh_checkpoint, short_tempdir

from pgbase.errors import PreloadGateError
from preload import protocol
from preload.client import DaemonClient
from preload.daemon.lock import RankLock
from preload.daemon.raw import fill_raw
from preload.daemon.server import RankServer
from preload.daemon.stage import Filled
from preload.transports import get_transport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

ROUNDS = 1000
CLIENTS = 4
F_GET_SEALS = 1034


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_checkpoint(tmp_path_factory.mktemp("race") / "ckpt", seed=11)


def _server(template: Filled, blob: bytes, root: Path, i: int,
            cls: type[RankServer] = RankServer) -> RankServer:
    """A server on a fresh copy of the template's arena (what fill_raw built)."""
    arena = get_transport("shm").create(template.layout)
    os.pwrite(arena.fds()[0], blob, 0)
    arena.seal()
    filled = dataclasses.replace(template, arena=arena)
    sdir = root / f"{i:05d}"
    sdir.mkdir(mode=0o700)
    server = cls(filled, sdir, 0, RankLock.acquire(sdir, 0), deadline_s=5.0)
    server.start()
    assert server._listener is not None
    server._listener.settimeout(0.005)  # stop() joins the accept loop: keep rounds short
    return server


def _check_fd(fd: int, size: int) -> str | None:
    """None when ``fd`` is the arena (a sealed memfd of the right size)."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        return f"bad descriptor: {exc}"
    if st.st_size != size:
        return f"descriptor of {st.st_size} bytes, the arena has {size}"
    if not seals:
        return "descriptor is not a sealed memfd"
    return None


def _round(template: Filled, blob: bytes, root: Path, i: int, action: str,
           cls: type[RankServer]) -> list[str]:
    server = _server(template, blob, root, i, cls)
    size = server.filled.layout.total_bytes
    key = template.key
    problems: list[str] = []
    oks = [0] * CLIENTS
    go = threading.Barrier(CLIENTS + 1)

    def client(n: int) -> None:
        try:
            c = DaemonClient.connect(server.socket_dir, 0, timeout_s=5, deadline_s=5)
        except PreloadGateError:
            go.wait()
            return
        go.wait()
        try:
            for _ in range(4):
                try:
                    frame = c._exchange({"cmd": "get_state", "key": key.to_json()})
                except PreloadGateError:
                    return  # the daemon stopped under us: an answer, not a fault
                try:
                    if frame.body.get("status") == "ok":
                        if len(frame.fds) != 1:
                            problems.append(f"ok reply with {len(frame.fds)} descriptors")
                        for fd in frame.fds:
                            bad = _check_fd(fd, size)
                            if bad:
                                problems.append(bad)
                        oks[n] += 1
                    elif frame.body.get("status") != "error":
                        problems.append(f"unexpected reply {frame.body.get('status')}")
                finally:
                    for fd in frame.fds:
                        os.close(fd)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    go.wait()
    if action == "release":
        server._release()
    else:
        server.stop()
    for t in threads:
        t.join(30)
        if t.is_alive():
            problems.append("a client hung")
    # Connection threads leave _conns only after their last counter moved.
    deadline = time.monotonic() + 30
    while server._conns and time.monotonic() < deadline:
        time.sleep(0.001)
    if server._conns:
        problems.append("a server connection thread hung")
    snap = server.snapshot()
    if snap["served"] != sum(oks):
        problems.append(f"server counted {snap['served']} served, clients received {sum(oks)} ok replies")
    if action == "release":
        server.stop()
    return problems


class _OldServer(RankServer):
    """The shape before the fix: descriptors read without the lock, the arena
    closed outside it, the hit counted before the reply is sent."""

    def _get_state(self, conn, key_obj, session):  # type: ignore[no-untyped-def]
        f = self.filled
        if self.released:
            self._reply(conn, protocol.error_reply("released"))
            return
        with self._mutex:
            self.stats.count_served(session)
        reply = {"status": "ok", **self._identity(), "entries": f.layout.to_json(),
                 "total_bytes": f.layout.total_bytes, "aliases": f.aliases,
                 "descriptor": {"kind": "shm", "size": f.layout.total_bytes}, "key": self.key.to_json(),
                 "checksums": f.checksums}
        fds = f.arena.fds()
        self._reply(conn, reply, [fd for fd in fds if fd >= 0])

    def _close_arena(self) -> None:
        self._arena_closed = True
        self.filled.arena.close()


def _hammer(ckpt: Path, cls: type[RankServer], rounds: int = ROUNDS, first: bool = False) -> list[str]:
    root = short_tempdir("pg-race-")
    template = fill_raw(ckpt, get_transport("shm"), None)
    blob = os.pread(template.arena.fds()[0], template.layout.total_bytes, 0)
    problems: list[str] = []
    try:
        for i in range(rounds):
            problems += [f"round {i}: {p}" for p in _round(template, blob, root, i, ("release", "stop")[i % 2], cls)]
            if first and problems:
                break
    finally:
        template.arena.close()
        shutil.rmtree(root, ignore_errors=True)
    return problems


def test_get_state_races_release_and_stop_cleanly(ckpt: Path) -> None:
    assert _hammer(ckpt, RankServer) == []


def test_control_old_server_shows_the_race(ckpt: Path) -> None:
    problems = _hammer(ckpt, _OldServer, first=True)
    assert problems, "the old shape should have sent a bad descriptor or miscounted in some round"
