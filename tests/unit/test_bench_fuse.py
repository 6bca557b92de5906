"""The bench's slow filesystem the kernel can see (``harness.bench.fuse_fs``).

- A mirror: stat through the mount equals the real file's (size, mtime,
  ctime, inode), listings and reads are the real ones, symlinks resolve.
- Replies are held back: a stat does not return while its reply is held
  and does once it is released (counted, not timed); latency 0: nothing held.
- Concurrency is the kernel's: a batch of stats through io_uring has every
  request at the server at once; control: io-wq's default worker limit
  (which the ring raises) caps it at 4 x CPUs. The thread pool does too.
- A dead server fails requests (ENOTCONN), it does not hang them.
- A dead client (the bench SIGKILLed inside the ``with``) leaves no mount
  and no server behind: the server sees its control pipe close and unmounts.
- Unmounting leaves no mount behind; not root or no /dev/fuse is a
  FuseUnavailableError saying which (those two run everywhere).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from reliability_support import skip_privileged

from harness.bench import fuse_fs
from harness.bench.fuse_fs import FuseFS, FuseUnavailableError, mounted
from preload.identity import filestat, uring
from preload.identity.filestat import FileStat, stat_all

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]



@pytest.fixture
def _fuse_mountable() -> None:
    """Mounting needs root (CI runs as root: there a skip fails, through
    skip_privileged) and the /dev/fuse device node (a machine without it is
    no privilege question: a plain skip saying so)."""
    if os.geteuid() != 0:
        skip_privileged("mounting FUSE needs root (no fusermount here)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse device node on this machine")


needs_root = pytest.mark.usefixtures("_fuse_mountable")


@pytest.fixture
def real(tmp_path):
    root = tmp_path / "real"
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 1000)
    os.utime(root / "a.bin", ns=(1, 1_600_000_000_123_456_789))
    (root / "sub" / "b.txt").write_text("bee")
    (root / "link").symlink_to("a.bin")
    for i in range(60):
        (root / f"f{i:02d}").write_bytes(b"x" * i)
    return root


@pytest.fixture
def mount(real):
    fs = FuseFS(real)
    mnt = fs.__enter__()
    yield fs, mnt
    fs.__exit__(None, None, None)
    assert not mounted(mnt) and not mnt.exists()


def _wait(predicate, seconds: float = 20.0) -> bool:
    deadline = threading.Event()
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        deadline.wait(0.02)
    return predicate()


@needs_root
def test_the_mount_mirrors_the_real_directory(real, mount):
    fs, mnt = mount
    assert mounted(mnt) and filestat.filesystem_type(mnt) == fuse_fs.FSTYPE
    for name in ("a.bin", "sub", "sub/b.txt", "link"):
        got, want = os.stat(mnt / name), os.stat(real / name)
        assert (got.st_size, got.st_mtime_ns, got.st_ctime_ns, got.st_ino, got.st_mode) == (
            want.st_size, want.st_mtime_ns, want.st_ctime_ns, want.st_ino, want.st_mode), name
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(real))
    assert os.listdir(mnt / "sub") == ["b.txt"]
    assert (mnt / "a.bin").read_bytes() == (real / "a.bin").read_bytes()
    assert (mnt / "link").read_bytes() == (real / "a.bin").read_bytes() and os.readlink(mnt / "link") == "a.bin"
    assert isinstance(stat_all([mnt / "missing"])[0], FileNotFoundError)
    with pytest.raises(OSError):
        (mnt / "new").write_text("no")  # read-only
    counts = fs.counts()
    assert counts["LOOKUP"] >= 4 and counts["READ"] >= 1 and counts["READDIR"] >= 2


@needs_root
def test_replies_are_held_for_the_latency(real, mount):
    fs, mnt = mount
    os.stat(mnt / "a.bin")  # the name is known: a stat is now one GETATTR
    fs.set_latency(600.0)
    fs.reset()
    done = threading.Event()
    t = threading.Thread(target=lambda: (os.stat(mnt / "a.bin"), done.set()))
    t.start()
    assert _wait(lambda: fs.counts().get("GETATTR") == 1)
    assert not done.is_set() and fs._ask("counts")["held"] == 1, "the stat waits on its held reply"
    fs.release()
    t.join(20)
    assert done.is_set()
    # Control: at latency 0 nothing is held.
    fs.set_latency(0.0)
    fs.reset()
    os.stat(mnt / "a.bin")
    assert fs.counts() == {"GETATTR": 1, "held_peak": 0}


def _peak(fs, mnt, n: int, settle_s: float) -> int:
    """Stat ``n`` files at once with every reply held; the most at the server together."""
    paths = [mnt / f"f{i:02d}" for i in range(n)]
    stat_all(paths)  # names known: one GETATTR each from now on
    fs.set_latency(600.0)
    fs.reset()
    out: list = []
    t = threading.Thread(target=lambda: out.extend(stat_all(paths)))
    t.start()
    _wait(lambda: fs.counts()["held_peak"] >= n, settle_s)
    peak = fs.counts()["held_peak"]
    fs.set_latency(0.0)
    fs.release()
    t.join(60)
    assert [r.size for r in out] == list(range(n)) and all(isinstance(r, FileStat) for r in out)
    return peak


@needs_root
@pytest.mark.skipif(uring.unavailable() is not None, reason=f"io_uring unavailable: {uring.unavailable()}")
def test_a_uring_batch_has_every_stat_at_the_server_at_once(mount, monkeypatch):
    fs, mnt = mount
    n = min(60, 4 * (os.cpu_count() or 1) + 20)
    monkeypatch.setenv(filestat.STAT_BACKEND_ENV, "uring")
    uring.reset()
    assert _peak(fs, mnt, n, 20.0) == n
    # Control: without raising io-wq's limit the kernel runs 4 x CPUs stats at once.
    monkeypatch.setattr(uring._Ring, "_max_workers", lambda self, k: 0)
    uring.reset()
    try:
        assert _peak(fs, mnt, n, 2.0) <= 4 * (os.cpu_count() or 1) < n
    finally:
        monkeypatch.undo()
        uring.reset()


@needs_root
def test_the_pool_has_every_stat_at_the_server_at_once(mount, monkeypatch):
    fs, mnt = mount
    monkeypatch.setenv(filestat.STAT_BACKEND_ENV, "pool")
    try:
        assert _peak(fs, mnt, 40, 20.0) == 40
    finally:
        filestat.stop_stat_workers()


@needs_root
def test_a_dead_server_fails_requests_instead_of_hanging_them(real):
    """The server holds the connection's only /dev/fuse descriptor: when it
    dies the kernel aborts the connection, so a stat fails (it used to wait
    forever when the parent kept a copy and the server had exited early)."""
    fs = FuseFS(real)
    mnt = fs.__enter__()
    try:
        assert os.stat(mnt / "a.bin").st_size == 256_000
        assert fs._server is not None
        fs._server.kill()
        fs._server.wait(20)
        with pytest.raises(OSError):
            os.stat(mnt / "a.bin")
    finally:
        fs.__exit__(None, None, None)
    assert not mounted(mnt)


# A bench reduced to its FUSE mount: it mounts, says where, and waits to be killed.
_CLIENT = """
import sys, time
from harness.bench.fuse_fs import FuseFS
fs = FuseFS(sys.argv[1])
mnt = fs.__enter__()
print(mnt, fs._server.pid, flush=True)
time.sleep(3600)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (an orphan whose reaper, PID 1 in a container, may not reap)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@needs_root
def test_a_killed_client_leaves_no_mount_and_no_server(real):
    """SIGKILL of the process inside ``with FuseFS(...)`` used to leave the
    mount and its server running forever (SIGTERM unwinds; SIGKILL runs no
    clean-up). The server now reads end of file on its control pipe, unmounts
    and exits. Control: while the client lives, both are there."""
    repo = Path(__file__).resolve().parents[2]
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(real)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    assert client.stdout is not None
    mnt_text, pid_text = client.stdout.readline().split()
    mnt, server = Path(mnt_text), int(pid_text)
    try:
        assert mounted(mnt) and not _gone(server), "control: the live client's mount serves"
        assert os.stat(mnt / "a.bin").st_size == 256_000
        client.kill()
        client.wait()
        assert _wait(lambda: not mounted(mnt), 60.0), f"{mnt} is still mounted after its client was killed"
        assert _wait(lambda: _gone(server), 60.0), f"the FUSE server (pid {server}) outlived its client"
        assert not mnt.exists(), "the mount point directory was left behind"
    finally:  # on failure, clean up as the server should have (on its own, old or new)
        client.kill()
        if mounted(mnt):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.umount2(os.fsencode(mnt), 2)  # MNT_DETACH
        if not _gone(server):
            os.kill(server, signal.SIGKILL)
        if mnt.exists():
            mnt.rmdir()


def test_not_root_is_a_clear_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(FuseUnavailableError, match="not root"), FuseFS(tmp_path):
        pass


def test_no_dev_fuse_is_a_clear_refusal(tmp_path, monkeypatch):
    # Temp dirs go under tmp_path: other workers' mounts in /tmp are not ours to judge.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_open = os.open
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (_ for _ in ()).throw(FileNotFoundError(2, "No such file"))
                        if p == "/dev/fuse" else real_open(p, *a, **k))
    with pytest.raises(FuseUnavailableError, match="/dev/fuse"), FuseFS(tmp_path):
        pass
    assert not [m for m in os.listdir(tmp_path) if m.startswith("pg-fuse-")]  # no mount point made, none left
