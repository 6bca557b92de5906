"""Stats through io_uring (``preload.identity.uring``) against ``os.stat``.

- Differential: for real files of every kind the restart check meets (a
  file, a directory, symlinks to both, a device, another filesystem), the
  batch's ``FileStat`` equals ``FileStat.of`` field for field, and each
  failure (missing, dangling symlink, under a file, empty, too long) is
  the ``OSError`` ``os.stat`` raises: same type, errno and filename.
- More paths than ring entries go in waves (control: the ring really is
  that small); a NUL byte is ``ValueError`` with nothing submitted.
- Where the kernel refuses io_uring, ``stat_all`` uses the thread pool
  (control: with io_uring it does not), and the refusal is logged once.
- ``PRELOAD_GATE_STAT_BACKEND``: pool forces the pool; a typo is one warning.
"""

from __future__ import annotations

import os
import platform

import pytest

from preload.identity import filestat, uring
from preload.identity.filestat import FileStat, stat_all

pytestmark = pytest.mark.unit

needs_uring = pytest.mark.skipif(uring.unavailable() is not None,
                                 reason=f"io_uring unavailable here: {uring.unavailable()}")


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv(filestat.STAT_BACKEND_ENV, raising=False)


def _os_stat(path):
    try:
        return FileStat.of(path)
    except OSError as exc:
        return exc


def _same(a, b) -> bool:
    if isinstance(a, OSError) or isinstance(b, OSError):
        return type(a) is type(b) and (a.errno, a.filename) == (b.errno, b.filename)
    return a == b


@pytest.fixture
def zoo(tmp_path):
    (tmp_path / "file").write_bytes(b"x" * 12345)
    os.utime(tmp_path / "file", ns=(1, 1_234_567_891_234_567_891))  # mtime != ctime: a swap shows
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    (tmp_path / "to-dir").symlink_to("dir")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    odd = os.fsencode(tmp_path) + b"/caf\xe9"  # not UTF-8: a surrogate-escaped str name
    with open(odd, "wb") as f:
        f.write(b"odd")
    paths = [tmp_path, tmp_path / "file", tmp_path / "empty", tmp_path / "dir", tmp_path / "to-file",
             str(tmp_path / "to-dir"), os.fsencode(tmp_path / "file"), os.fsdecode(odd), "/dev/null", "/proc/self",
             tmp_path / "missing", tmp_path / "dangling", tmp_path / "file" / "under-a-file", "",
             str(tmp_path / ("n" * 300)), "/" + "d/" * 3000]
    if os.path.isdir("/dev/shm"):
        paths.append("/dev/shm")
    return paths


@needs_uring
def test_the_batch_equals_os_stat_field_for_field(zoo):
    got = stat_all(zoo)
    assert filestat.stat_backend() == "uring"
    want = [_os_stat(p) for p in zoo]
    for p, g, w in zip(zoo, got, want, strict=True):
        assert _same(g, w), (p, g, w)
    kinds = {type(w).__name__ for w in want}
    # Control: the zoo has successes and each failure kind, so equality is not vacuous.
    assert {"FileStat", "FileNotFoundError", "NotADirectoryError", "OSError"} <= kinds
    assert any(isinstance(w, OSError) and w.errno == 36 for w in want), "ENAMETOOLONG is in the zoo"
    # A symlink is followed (no AT_SYMLINK_NOFOLLOW), as os.stat does: the target's inode, not the link's.
    assert got[4] == got[1] and got[4].ino != os.lstat(zoo[4]).st_ino


@needs_uring
def test_more_paths_than_ring_entries_go_in_waves(tmp_path, monkeypatch):
    files = []
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(b"y" * i)
        files.append(tmp_path / f"f{i}")
    monkeypatch.setattr(uring, "MAX_ENTRIES", 8)
    uring.reset()
    try:
        out = stat_all(files + [tmp_path / "missing"])
        assert uring._ring is not None and uring._ring.entries == 8, "control: the ring holds 8"
    finally:
        uring.reset()
    assert [r.size for r in out[:50]] == list(range(50))
    assert out[:50] == [FileStat.of(f) for f in files] and isinstance(out[50], FileNotFoundError)


@needs_uring
def test_a_nul_byte_raises_before_anything_is_submitted(tmp_path, monkeypatch):
    submitted = []
    monkeypatch.setattr(uring, "statx_many", lambda paths: submitted.append(paths) or [])
    with pytest.raises(ValueError, match="null"):
        stat_all([tmp_path, "bad\0path"])
    assert submitted == []


@needs_uring
def test_the_ring_lets_the_kernel_run_a_wave_at_once():
    """STATX is io-wq "bounded" work, limited by default to 4 x CPUs."""
    assert uring.setup()
    assert uring._ring is not None and uring._ring.workers >= uring.MAX_ENTRIES


@pytest.mark.parametrize("refusal", ["not-wired", "ENOSYS"])
def test_where_io_uring_is_refused_the_pool_does_the_stats(tmp_path, monkeypatch, caplog, refusal):
    monkeypatch.setattr(uring, "_ring", None)
    monkeypatch.setattr(uring, "_refused", None)
    if refusal == "not-wired":
        monkeypatch.setattr(uring, "_SYSCALLS", {})
    else:  # a syscall number no kernel has: io_uring_setup fails as where it is compiled out
        monkeypatch.setattr(uring, "_SYSCALLS", {platform.machine(): (100_000, 426, 427)})
    pooled = []
    real = FileStat.of.__func__
    monkeypatch.setattr(FileStat, "of", classmethod(lambda cls, p: (pooled.append(p), real(cls, p))[1]))
    with caplog.at_level("INFO", logger="preload.identity"):
        assert uring.unavailable() is not None
        out = stat_all([tmp_path, tmp_path / "missing"])
        stat_all([tmp_path])
    assert isinstance(out[0], FileStat) and isinstance(out[1], FileNotFoundError)
    assert len(pooled) == 3 and filestat.stat_backend() == "pool"
    assert len([r for r in caplog.records if "io_uring unavailable" in r.getMessage()]) == 1
    if refusal == "ENOSYS":
        assert "not implemented" in uring.unavailable()


@needs_uring
def test_control_with_io_uring_the_pool_is_not_used(tmp_path, monkeypatch):
    pooled = []
    real = FileStat.of.__func__
    monkeypatch.setattr(FileStat, "of", classmethod(lambda cls, p: (pooled.append(p), real(cls, p))[1]))
    assert isinstance(stat_all([tmp_path])[0], FileStat) and pooled == []
    monkeypatch.setenv(filestat.STAT_BACKEND_ENV, "pool")
    assert isinstance(stat_all([tmp_path])[0], FileStat) and pooled == [tmp_path]


def test_a_bad_backend_is_one_warning_and_auto(monkeypatch, caplog):
    monkeypatch.setattr(filestat, "_warned", set())
    with caplog.at_level("WARNING", logger="preload.identity"):
        for _ in range(3):
            got = filestat.stat_backend({filestat.STAT_BACKEND_ENV: "io-uring"})
    assert got == filestat.stat_backend({})
    (rec,) = caplog.records
    assert filestat.STAT_BACKEND_ENV in rec.getMessage() and "auto" in rec.getMessage()
    assert filestat.stat_backend({filestat.STAT_BACKEND_ENV: " POOL "}) == "pool"


def test_prestart_sets_up_the_ring_or_starts_the_pool(monkeypatch):
    started = []
    monkeypatch.setattr(filestat.stat_pool, "prestart_stat_workers", lambda n: started.append(n))
    assert filestat.prestart_stats(0) is None and started == []
    monkeypatch.setenv(filestat.STAT_BACKEND_ENV, "pool")
    filestat.prestart_stats(100)
    assert started == [100]
    if uring.unavailable() is None:
        monkeypatch.setenv(filestat.STAT_BACKEND_ENV, "uring")
        uring.reset()
        filestat.prestart_stats(100)
        assert started == [100] and uring._ring is not None, "uring: a ring, no threads"
