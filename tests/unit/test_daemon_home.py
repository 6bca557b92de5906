"""Where daemons live, and what happens when their home is cleaned (field cases r03, r10).

- Two sessions of one user that disagree about ``XDG_RUNTIME_DIR`` and
  ``TMPDIR`` (a login shell, cron, ``sudo -u``) find the same daemon: one
  resident copy, ``status`` and an engine-side attach see it from both.
- A temp-file cleaner removes a live daemon's lock file, or its whole socket
  directory: the daemon re-creates them, stays reachable, and a second
  daemon for the digest is refused (one copy); stopping it leaves nothing.
- A daemon removes only the files it created (checked by inode), so
  stopping an old daemon never takes a successor's socket or lock.

Controls: a session with another socket root finds nothing; with the home
watch switched off (a negative-control switch, never for use) the removed
directory stays gone, the daemon is unreachable and a second copy starts;
a stale socket file is replaced while a live one is not.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_support import REPO, Daemon, short_dir

from fixtures.tiny import write_tiny
from preload.daemon.home import UNSAFE_NO_WATCH_ENV, inode_of, unlink_if
from preload.daemon.lock import RankBusyError, RankLock, lock_holder, socket_answers
from preload.promote import promote
from preload.sockets import default_socket_root, legacy_socket_roots

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="daemon_home")]

REPAIR_WAIT_S = 60.0  # a bound on waiting for the watcher (it checks once a second), not a timing claim


def wait_until(cond, what: str, bound: float = REPAIR_WAIT_S) -> None:
    end = time.monotonic() + bound
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {bound:g} s: {what}")
        time.sleep(0.2)


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preload_gate.cli", *args], capture_output=True, text=True,
                          env=env, timeout=180, cwd=REPO)


def attach(env: dict[str, str], ckpt: Path) -> str:
    """What an engine does: find the daemon by digest, attach, close."""
    code = ("from preload.hf_attach import attach_model\n"
            "try:\n"
            f"    m = attach_model({str(ckpt)!r}, device='cpu', verify=False, watch=False); print('ATTACHED'); m.close()\n"
            "except Exception as e:\n    print('ERROR', type(e).__name__, e)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180,
                          cwd=REPO).stdout.strip()


def serving(env: dict[str, str], root: Path | None = None) -> list[dict]:
    args = ["status", "--json"] + (["--socket-root", str(root)] if root else [])
    p = run_cli(env, *args)
    assert p.returncode == 0, p.stderr
    return [r for r in json.loads(p.stdout)["ranks"] if r["serving"]]


# ------------------------------------------------------------------ the default root

def test_default_root_does_not_depend_on_the_session(monkeypatch, tmp_path) -> None:
    import tempfile

    monkeypatch.delenv("PRELOAD_GATE_SOCKET_ROOT", raising=False)
    # gettempdir() caches TMPDIR in tempfile.tempdir; restored after the test,
    # so no later test inherits this test's TMPDIR, whether it passes or not.
    monkeypatch.setattr(tempfile, "tempdir", None)
    roots = set()
    for xdg, tmpdir in ((str(tmp_path / "run"), str(tmp_path / "a")), (None, str(tmp_path / "b")), (None, None)):
        (tmp_path / "run").mkdir(exist_ok=True)
        for name, value in (("XDG_RUNTIME_DIR", xdg), ("TMPDIR", tmpdir)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        tempfile.tempdir = None  # gettempdir() re-reads TMPDIR
        roots.add(default_socket_root())
    assert roots == {Path(f"/tmp/preload-gate-{os.getuid()}")}
    # control: the old rule followed XDG_RUNTIME_DIR, which one session has and another does not
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert tmp_path / "run" / "preload-gate" in legacy_socket_roots()
    monkeypatch.setenv("PRELOAD_GATE_SOCKET_ROOT", str(tmp_path / "explicit"))
    assert default_socket_root() == tmp_path / "explicit"


def test_two_sessions_of_one_user_find_one_daemon(tmp_path, monkeypatch) -> None:
    ckpt = write_tiny(tmp_path / "ckpt", seed=1414)
    base = {k: v for k, v in os.environ.items()
            if k not in ("PRELOAD_GATE_SOCKET_ROOT", "XDG_RUNTIME_DIR", "TMPDIR", "PRELOAD_GATE_EVENTS")}
    base["PRELOAD_GATE_CACHE"] = str(tmp_path / "cache")
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "ta").mkdir()
    (tmp_path / "tb").mkdir()
    session_a = {**base, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "TMPDIR": str(tmp_path / "ta")}
    session_b = {**base, "TMPDIR": str(tmp_path / "tb")}
    for k in ("PRELOAD_GATE_SOCKET_ROOT", "XDG_RUNTIME_DIR", "TMPDIR"):
        monkeypatch.delenv(k, raising=False)
    p = run_cli(session_a, "promote", str(ckpt), "--json")
    assert p.returncode == 0, p.stderr
    sdir = Path(json.loads(p.stdout)["socket_dir"])
    assert sdir.parent == Path(f"/tmp/preload-gate-{os.getuid()}")
    d = Daemon(ckpt, None, tmp_path / "cache", env={"XDG_RUNTIME_DIR": str(tmp_path / "run"),
                                                   "TMPDIR": str(tmp_path / "ta")})
    second = None
    try:
        d.start()
        assert Path(d.ready["socket_dir"]) == sdir
        for session in (session_a, session_b):
            assert [r["pid"] for r in serving(session)
                    if r["socket"].startswith(str(sdir))] == [d.rank_pid]
            assert attach(session, ckpt) == "ATTACHED"
        # session B starting "its" daemon is refused: one resident copy
        second = Daemon(ckpt, None, tmp_path / "cache", env={"TMPDIR": str(tmp_path / "tb")})
        second.start(expect_ready=False)
        assert second.proc is not None and second.proc.returncode != 0
        assert "already serves rank 0" in second.output
        # control: a session whose root differs (what XDG_RUNTIME_DIR did) finds nothing there,
        other_root = short_dir("pg-other-")
        other = {**session_b, "PRELOAD_GATE_SOCKET_ROOT": str(other_root)}
        assert serving(other, other_root) == []
        assert attach(other, ckpt).startswith("ERROR")
        # though its plain `status` still names the daemon and its root (the user's registry)
        assert [r["socket_root"] for r in serving(other) if r["socket"].startswith(str(sdir))] == [str(sdir.parent)]
        shutil.rmtree(other["PRELOAD_GATE_SOCKET_ROOT"])
    finally:
        if second is not None:
            second.stop()
        d.stop()
        shutil.rmtree(sdir, ignore_errors=True)
    assert not (sdir / "rank0.sock").exists()


# ------------------------------------------------------------------ cleaners under a live daemon

@pytest.fixture
def scene(tmp_path):
    ckpt = write_tiny(tmp_path / "ckpt", seed=1415)
    root = short_dir("pg-home-")
    cache = tmp_path / "cache"
    promote(ckpt, socket_root=root, cache_dir=cache, progress=False)
    env = {**os.environ, "PRELOAD_GATE_CACHE": str(cache), "PRELOAD_GATE_SOCKET_ROOT": str(root)}
    env.pop("PRELOAD_GATE_EVENTS", None)
    daemons: list[Daemon] = []

    def daemon(**extra: str) -> Daemon:
        daemons.append(Daemon(ckpt, root, cache, env=dict(extra)))
        return daemons[-1]
    yield {"ckpt": ckpt, "root": root, "env": env, "daemon": daemon}
    for d in daemons:
        d.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("cleaner", ["lock_removed", "directory_removed"])
def test_cleaned_home_is_repaired_nothing_lost_no_second_copy(scene, cleaner) -> None:
    d1 = scene["daemon"]().start()
    sdir = d1.socket_dir
    sock, lock = sdir / "rank0.sock", sdir / "rank0.lock"
    before = {p: inode_of(p) for p in (sdir, sock, lock)}
    if cleaner == "lock_removed":
        lock.unlink()
        wait_until(lock.exists, "the lock file re-created")
        assert lock_holder(sdir, 0) == str(d1.rank_pid)
        assert inode_of(sock) == before[sock]  # the live socket was left alone
    else:
        shutil.rmtree(sdir)
        wait_until(lambda: sock.exists() and lock.exists(), "directory, socket and lock re-created")
        assert oct(sdir.stat().st_mode & 0o777) == "0o700"
    assert attach(scene["env"], scene["ckpt"]) == "ATTACHED"
    d2 = scene["daemon"]().start(expect_ready=False)
    assert d2.proc is not None and d2.proc.returncode != 0 and "already serves rank 0" in d2.output
    assert [r["pid"] for r in serving(scene["env"])] == [d1.rank_pid]  # one copy
    assert d1.proc is not None and d1.proc.poll() is None
    assert d1.stop() == 0
    assert not sdir.exists()  # it removed what it had made; rmdir proves nothing else was there


def test_control_without_the_home_watch_the_cleaned_daemon_is_lost(scene) -> None:
    """The failure the watch prevents (r10): the directory goes, the daemon
    stays resident but unreachable, and a second copy starts. Stopping the
    old one afterwards leaves the successor's files alone (inode checks)."""
    d1 = scene["daemon"](**{UNSAFE_NO_WATCH_ENV: "1"}).start()
    sdir = d1.socket_dir
    shutil.rmtree(sdir)
    time.sleep(3)  # three watch intervals: a watching daemon would have re-created it
    assert not sdir.exists()
    assert attach(scene["env"], scene["ckpt"]).startswith("ERROR")
    d2 = scene["daemon"]().start()  # a second resident copy: what the watch prevents
    assert d1.proc is not None and d1.proc.poll() is None
    theirs = {p: inode_of(sdir / p) for p in ("rank0.sock", "rank0.lock")}
    assert d1.stop() == 0
    assert {p: inode_of(sdir / p) for p in theirs} == theirs  # the old daemon removed nothing of d2's
    assert attach(scene["env"], scene["ckpt"]) == "ATTACHED"
    assert [r["pid"] for r in serving(scene["env"])] == [d2.rank_pid]


# ------------------------------------------------------------------ stale means nothing answers

def test_a_socket_is_stale_only_when_nothing_answers(tmp_path) -> None:
    d = short_dir("pg-stale-")
    try:
        sock = d / "rank0.sock"
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        live.bind(str(sock))
        live.listen(1)
        assert socket_answers(sock)
        # the lock file is absent (a cleaner removed it) and free: still refused, the socket answers
        with pytest.raises(RankBusyError, match="a live daemon answers"):
            RankLock.acquire(d, 0)
        assert not (d / "rank0.lock").exists()  # the refused newcomer removed the lock it made
        live.close()
        # control: the same file with nothing behind it is stale, and the lock is taken
        assert not socket_answers(sock)
        lock = RankLock.acquire(d, 0)
        assert lock_holder(d, 0) == str(os.getpid())
        lock.release()
        assert lock_holder(d, 0) is None and not (d / "rank0.lock").exists()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_files_are_removed_only_by_inode(tmp_path) -> None:
    p = tmp_path / "rank0.lock"
    p.write_text("1\n")
    # The daemon holds what it created open (the lock's fd, the bound
    # listener), so the inode number cannot be reused while it runs; so here.
    held = os.open(p, os.O_RDONLY)
    mine = inode_of(p)
    p.unlink()
    p.write_text("2\n")  # a successor's file at the same path
    assert not unlink_if(p, mine) and p.read_text() == "2\n"
    os.close(held)
    # control: our own file goes
    assert unlink_if(p, inode_of(p)) and not p.exists()
    # and a lock whose file was replaced does not remove the replacement on release
    d = short_dir("pg-ino-")
    try:
        lock = RankLock.acquire(d, 0)
        (d / "rank0.lock").unlink()
        (d / "rank0.lock").write_text("other\n")
        lock.release()
        assert (d / "rank0.lock").read_text() == "other\n"
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ the watch, one pass at a time

class _FakeHome:
    """What HomeWatch needs of a RankServer: a directory, a bound socket, a lock."""

    def __init__(self, d: Path) -> None:
        self.socket_dir, self.path = d, d / "rank0.sock"
        self._lock = RankLock.acquire(d, 0)
        self.listeners: list[socket.socket] = []
        self.rebind()

    @property
    def lock(self) -> RankLock:
        return self._lock

    def socket_inode(self):
        return self._inode

    def rebind(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.path))
        s.listen(1)
        self.listeners.append(s)
        self._inode = inode_of(self.path)

    def close(self) -> None:
        for s in self.listeners:
            s.close()
        self._lock.release()


@pytest.fixture
def home():
    from preload.daemon.home import HomeWatch

    d = short_dir("pg-watch-")
    h = _FakeHome(d)
    lost: list[str] = []
    w = HomeWatch(h, lost.append, busy_grace_s=0.0)
    yield h, w, lost
    h.close()
    shutil.rmtree(d, ignore_errors=True)


def test_watch_pass_repairs_a_removed_socket_and_changes_nothing_when_intact(home) -> None:
    h, w, lost = home
    w.check()
    assert w.repairs == [] and lost == [] and len(h.listeners) == 1  # control: nothing to do
    h.path.unlink()
    w.check()
    assert len(h.listeners) == 2 and socket_answers(h.path) and lost == []
    assert "was removed; bound again" in w.repairs[0]


def test_watch_pass_stops_the_daemon_when_another_answers_in_its_place(home) -> None:
    h, w, lost = home
    h.path.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(h.path))
    other.listen(1)
    try:
        w.check()
    finally:
        other.close()
    assert lost and "another process answers on" in lost[0] and len(h.listeners) == 1


def test_watch_pass_stops_the_daemon_when_another_holds_its_lock(home) -> None:
    import fcntl

    h, w, lost = home
    (h.socket_dir / "rank0.lock").unlink()
    fd = os.open(h.socket_dir / "rank0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: a conflicting holder
    try:
        w.check()  # first sight starts the grace period (0 s here)
        time.sleep(0.01)
        w.check()
    finally:
        os.close(fd)
    assert lost and "holds" in lost[0]
    # control: once that holder is gone the lock file is reclaimed, not lost
    lost.clear()
    w.check()
    assert lost == [] and h.lock.holds_path()
