"""Restart identity: one concurrent round of stats; a stale manifest is a named miss.

- An unchanged manifest resolves with stats only (no open, no read).
- A stale manifest (an edit whose mtime was restored; a new
  ``consolidated.safetensors`` that switches vLLM's file set; a shard
  removed or renamed) or a missing one is a StaleManifestError naming the
  shard (missing and new ones too) and ``preload-gate promote``;
  the checkpoint is not opened (the shim counts opens and reads) and the
  manifest's bytes are unchanged (nothing re-hashed, nothing rewritten).
- Stats are issued concurrently: a barrier that every stat must reach
  before any returns passes; the control (the same stats one after another)
  breaks it.
- ``stat_all``: results in input order whatever order the stats finish in,
  per-path OSError as values, 0 paths and more than MAX_STATS_IN_FLIGHT,
  parked workers reused (and a stop honoured), a forked child, a thread
  that cannot start; one in-place edit among 1,000 shards is caught.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import shutil
import tempfile
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from fixtures.mutations import copy_checkpoint
from harness.bench.remote_fs import RemoteFS
from preload.identity import anchors, stat_pool, uring
from preload.identity import filestat as filestat_mod
from preload.identity import manifest as manifest_mod
from preload.identity.filestat import FileStat, stat_all
from preload.identity.manifest import StaleManifestError, manifest_path, resolve_digest
from preload.promote import promote

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _pool_backend(monkeypatch):
    """The thread pool issues the stats here: the shim (RemoteFS) counts them
    and the fake ``FileStat.of`` below stands in for them, and both see only
    stats issued from Python. Tests marked with ``backend`` run both ways;
    io_uring's own tests are in test_identity_uring.py."""
    monkeypatch.setenv(filestat_mod.STAT_BACKEND_ENV, "pool")


@pytest.fixture(params=["pool", "uring"])
def backend(request, monkeypatch):
    if request.param == "uring" and uring.unavailable() is not None:
        pytest.skip(f"io_uring unavailable here: {uring.unavailable()}")
    monkeypatch.setenv(filestat_mod.STAT_BACKEND_ENV, request.param)
    assert filestat_mod.stat_backend() == request.param
    return request.param


@pytest.fixture
def promoted(tiny_checkpoint, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmp_path / "ckpt")
    cache = tmp_path / "cache"
    p = promote(ckpt, socket_root=tmp_path / "sock", cache_dir=cache, progress=False)
    return ckpt, cache, p


def _stale(ckpt, cache):
    """Resolve in stat mode under the counting shim; returns (error, counts, manifest bytes before/after)."""
    mpath = manifest_path(ckpt, cache)
    before = mpath.read_bytes()
    with RemoteFS([ckpt]) as fs, pytest.raises(StaleManifestError) as info:
        resolve_digest(ckpt, mode="stat", cache_dir=cache)
    return info.value, fs.counts, before, mpath.read_bytes()


def test_unchanged_manifest_costs_stats_only(promoted):
    ckpt, cache, p = promoted
    with RemoteFS([ckpt]) as fs:
        res = resolve_digest(ckpt, mode="stat", cache_dir=cache)
    assert (res.digest, res.source) == (p.digest, "manifest")
    assert fs.counts.opens == fs.counts.reads == fs.counts.listdirs == 0
    # One concurrent round: the directory, the index, each shard.
    assert fs.counts.stats == 2 + len(p.manifest.shards)


def test_stale_shard_is_named_and_nothing_is_read_or_rewritten(promoted):
    ckpt, cache, p = promoted
    shard = ckpt / p.manifest.shards[1].name
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 2)
        f.write(b"\x3f\x80")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    err, counts, before, after = _stale(ckpt, cache)
    assert err.shard == shard.name and "ctime_ns" in str(err)
    assert f"run: preload-gate promote {ckpt}" in str(err)
    assert counts.opens == 0 and counts.reads == 0
    assert after == before
    assert sorted(p.name for p in (cache / "manifests").iterdir()) == [manifest_path(ckpt, cache).name]
    # Control: the shim does see opens; a re-hash (what engines used to do) opens every shard.
    with RemoteFS([ckpt]) as fs:
        anchors.content(ckpt, "full")
    assert fs.counts.opens >= len(p.manifest.shards)


def test_a_new_consolidated_file_is_seen_by_the_directory_stat(promoted):
    """vLLM's auto would switch to the mistral file set; no shard's stat changed."""
    ckpt, cache, p = promoted
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(ckpt / "consolidated.safetensors"))
    err, counts, before, after = _stale(ckpt, cache)
    assert "vLLM's file set may differ" in str(err) and err.shard is None
    assert "consolidated.safetensors added" in str(err)  # named, from one listing of the changed directory
    assert counts.opens == 0 and after == before


def test_a_removed_or_renamed_shard_is_named(promoted):
    """A shard removed after promotion changes the directory's stat first:
    the message names the missing shard (and a new one, for a rename), not
    only "a directory change" (new-user F6)."""
    ckpt, cache, p = promoted
    gone, other = p.manifest.shards[1].name, p.manifest.shards[0].name
    (ckpt / gone).unlink()
    err, counts, before, after = _stale(ckpt, cache)
    assert f"shard {gone} removed" in str(err) and err.shard == gone and other not in str(err)
    assert " added" not in str(err) and counts.opens == 0 and after == before
    # Renamed: the same inode under the new name (one listing, no open).
    (ckpt / other).rename(ckpt / "model-renamed.safetensors")
    err, counts, _, _ = _stale(ckpt, cache)
    assert f"stale: shard {other} renamed to model-renamed.safetensors; shard {gone} removed," in str(err)
    assert counts.opens == 0
    assert len(str(err).splitlines()) == 1 and f"run: preload-gate promote {ckpt}" in str(err)


def test_a_consolidated_file_in_an_existing_subfolder_is_seen(promoted):
    """vLLM's auto looks for consolidated*.safetensors at any depth (rglob), so
    a file added inside a folder that already existed switches its file set,
    and only that folder's stat changes (the top directory's does not)."""
    ckpt, cache, _ = promoted
    (ckpt / "original").mkdir()
    promote(ckpt, socket_root=ckpt.parent / "sock", cache_dir=cache, progress=False)
    top = os.stat(ckpt)
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(ckpt / "original" / "consolidated.safetensors"))
    assert os.stat(ckpt).st_mtime_ns == top.st_mtime_ns  # the top directory saw nothing
    err, counts, before, after = _stale(ckpt, cache)
    assert "original/consolidated.safetensors added" in str(err) and err.shard is None
    assert counts.opens == 0 and after == before


def test_a_manifest_without_subfolder_stats_is_stale(promoted):
    ckpt, cache, p = promoted
    old = dataclasses.replace(p.manifest, subdir_stats=None)
    assert manifest_mod.stale_reason(ckpt, old) == ("the manifest predates subfolder stats", None)
    assert manifest_mod.stale_reason(ckpt, p.manifest) is None  # control


def _mmap_zero_tail(shard) -> None:
    """Zero the last 4 bytes of ``shard`` in place through a shared mapping,
    after reading them first (as numpy.memmap(mode="r+") code does)."""
    with open(shard, "r+b") as f, mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED) as mm:
        assert mm[-4:] != b"\0" * 4
        mm[-4:] = b"\0" * 4
        mm.flush()


@pytest.fixture
def tmpfs_dir(tmp_path):
    shm = "/dev/shm"
    if filestat_mod.filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        from reliability_support import skip_privileged

        # A failure instead under CI's PRELOAD_GATE_STRICT_SKIPS=1 (CI has one).
        skip_privileged("no writable tmpfs at /dev/shm on this machine")
    d = tempfile.mkdtemp(prefix="pg-tmpfs-", dir=shm)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_on_tmpfs_stats_cannot_see_an_mmap_edit_so_stat_mode_misses(tiny_checkpoint, tmpfs_dir, tmp_path):
    """The field case: a checkpoint on /dev/shm, edited in place through mmap
    after promotion. No stat field changes, so a stat check alone would hit on
    the promoted digest while the bytes are new; stat mode refuses tmpfs."""
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmpfs_dir / "ckpt")
    cache = tmp_path / "cache"
    p = promote(ckpt, socket_root=tmp_path / "sock", cache_dir=cache, progress=False)
    shard = ckpt / p.manifest.shards[0].name
    before = FileStat.of(shard)
    _mmap_zero_tail(shard)
    # The hole is real here: same stat, other bytes.
    assert FileStat.of(shard) == before
    assert anchors.content(ckpt, "full") != p.digest
    err, counts, mbefore, mafter = _stale(ckpt, cache)
    assert "tmpfs" in str(err) and "'pinned'" in str(err) and "'full'" in str(err)
    # Promoting again cannot make stats prove content here: no promote command to run.
    assert "run:" not in str(err) and "preload-gate promote" not in str(err)
    assert isinstance(err, manifest_mod.StatBlindError)
    assert counts.opens == 0 and mafter == mbefore
    assert not p.to_json()["stat_identity"]


def test_control_on_a_disk_filesystem_the_same_promotion_resolves(tiny_checkpoint, tmp_path):
    """The neighbour row: the same checkpoint on the machine's disk resolves in
    stat mode, so the tmpfs refusal above is the filesystem rule, not the edit."""
    if filestat_mod.filesystem_type(tmp_path) in filestat_mod.STAT_BLIND_FILESYSTEMS:
        pytest.skip("tmp_path is itself on a stat-blind filesystem")
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmp_path / "ckpt")
    p = promote(ckpt, socket_root=tmp_path / "sock", cache_dir=tmp_path / "cache", progress=False)
    assert resolve_digest(ckpt, mode="stat", cache_dir=tmp_path / "cache").digest == p.digest
    assert p.to_json()["stat_identity"]
    # A stale manifest, which promoting again does fix, still names the command.
    _mmap_zero_tail(ckpt / p.manifest.shards[0].name)
    with pytest.raises(StaleManifestError) as info:
        resolve_digest(ckpt, mode="stat", cache_dir=tmp_path / "cache")
    assert "is stale" in str(info.value) and f"run: preload-gate promote {ckpt}" in str(info.value)


def test_filesystem_type_reads_mountinfo() -> None:
    assert filestat_mod.filesystem_type("/proc") == "proc"
    assert filestat_mod.filesystem_type("/proc/self/status") == "proc"  # its own mount, not "/"
    assert filestat_mod.filesystem_type_of_dev(os.stat("/proc").st_dev) == "proc"
    assert filestat_mod.filesystem_type("/") not in ("", "proc")


def test_missing_manifest_names_the_command(tiny_ckpt, tmp_path):
    with pytest.raises(StaleManifestError, match=r"no promotion manifest .* run: preload-gate promote"):
        resolve_digest(tiny_ckpt, mode="stat", cache_dir=tmp_path / "empty-cache")
    assert not (tmp_path / "empty-cache").exists()


def test_stats_are_in_flight_together(tmp_path, monkeypatch):
    files = []
    for i in range(24):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"x")
        files.append(f)
    barrier = threading.Barrier(len(files), timeout=20)
    real = FileStat.of.__func__

    def waiting(cls, path):
        barrier.wait()  # returns only once every stat is in flight
        return real(cls, path)

    monkeypatch.setattr(FileStat, "of", classmethod(waiting))
    assert all(isinstance(r, FileStat) for r in stat_all(files))
    # Control: the same stats one after another never fill the barrier.
    barrier.reset()
    serial = threading.Barrier(len(files), timeout=0.5)
    monkeypatch.setattr(FileStat, "of", classmethod(lambda cls, p: (serial.wait(), real(cls, p))[1]))
    with pytest.raises(threading.BrokenBarrierError):
        [FileStat.of(f) for f in files]


# -- stat_all: order, errors, sizes, reuse ------------------------------------------


@pytest.fixture
def quick_idle(monkeypatch):
    """Parked stat workers leave after 0.2 s idle, so a test leaves no threads behind."""
    monkeypatch.setattr(stat_pool, "STAT_WORKER_IDLE_S", 0.2)
    yield
    filestat_mod.stop_stat_workers()


def _fake_stat(i: int) -> FileStat:
    return FileStat(size=i, mtime_ns=i, ctime_ns=i, ino=i, dev=0)


def test_stat_all_keeps_input_order_when_completion_is_reversed(monkeypatch, quick_idle):
    """Stat i returns only after stat i+1 has: completion order is the reverse
    of the input, and the results are still in input order."""
    n = 40
    finished = [threading.Event() for _ in range(n + 1)]
    finished[n].set()
    completion = []

    def chained(cls, path):
        i = int(os.fspath(path))
        assert finished[i + 1].wait(20), "stats are not all in flight together"
        completion.append(i)
        finished[i].set()
        return _fake_stat(i)

    monkeypatch.setattr(FileStat, "of", classmethod(chained))
    out = stat_all([str(i) for i in range(n)])
    assert [r.size for r in out] == list(range(n))
    # Control: completion really was out of order, so in-order results are not luck.
    assert completion == list(range(n - 1, -1, -1))


def test_stat_all_turns_oserror_into_values(tmp_path, quick_idle, backend):
    present = tmp_path / "present"
    present.write_bytes(b"x")
    out = stat_all([present, tmp_path / "missing", present / "under-a-file", tmp_path])
    assert isinstance(out[0], FileStat) and out[0].size == 1
    assert isinstance(out[1], FileNotFoundError) and out[1].filename == str(tmp_path / "missing")
    assert isinstance(out[2], NotADirectoryError)
    assert isinstance(out[3], FileStat) and out[3] == FileStat.of(tmp_path)


def test_stat_all_raises_other_errors_and_its_workers_survive(tmp_path, quick_idle, backend):
    with pytest.raises(ValueError, match="null"):
        stat_all([tmp_path, "bad\0path", tmp_path])
    assert all(isinstance(r, FileStat) for r in stat_all([tmp_path] * 5))


def test_stat_all_of_nothing_starts_nothing(monkeypatch):
    import _thread

    started = []
    monkeypatch.setattr(_thread, "start_new_thread", lambda *a: started.append(a))
    assert stat_all([]) == []
    assert started == []


@pytest.mark.parametrize("limit", [3, None], ids=["patched-limit", "real-limit"])
def test_stat_all_beyond_the_in_flight_limit(monkeypatch, quick_idle, limit):
    """More paths than MAX_STATS_IN_FLIGHT (real: 1,024; a cheap fake stat, no
    files): every result, in order, and never more than the limit in flight."""
    if limit is not None:
        monkeypatch.setattr(filestat_mod, "MAX_STATS_IN_FLIGHT", limit)
    cap = filestat_mod.MAX_STATS_IN_FLIGHT
    n = cap + 7
    lock, now, peak = threading.Lock(), [0], [0]

    def counted(cls, path):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            threading.Event().wait(0.001)
            return _fake_stat(int(path))
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(FileStat, "of", classmethod(counted))
    out = stat_all([str(i) for i in range(n)])
    assert [r.size for r in out] == list(range(n))
    assert 1 <= peak[0] <= cap


def test_parked_workers_are_reused_and_leave_when_idle(tmp_path, monkeypatch, quick_idle):
    import _thread

    filestat_mod.stop_stat_workers()
    real_start = _thread.start_new_thread
    started = []

    def counting(fn, args):
        started.append(fn)
        return real_start(fn, args)

    monkeypatch.setattr(_thread, "start_new_thread", counting)
    monkeypatch.setattr(stat_pool, "STAT_WORKER_IDLE_S", 30.0)
    files = [tmp_path] * 12
    stat_all(files)
    assert len(started) == 12, "a cold call starts one worker per stat"
    stat_all(files)
    assert len(started) == 12, "a second call wakes the parked workers"
    assert filestat_mod.stop_stat_workers() == 0
    stat_all(files)
    assert len(started) == 24, "control: after a stop the next call starts its own again"
    monkeypatch.setattr(stat_pool, "STAT_WORKER_IDLE_S", 0.05)
    filestat_mod.stop_stat_workers()
    assert filestat_mod.start_stat_workers(4) == 4
    # Idle workers leave on their own (this waits; it asserts no duration).
    for _ in range(400):
        if stat_pool._workers.parked() == 0:
            break
        threading.Event().wait(0.05)
    assert stat_pool._workers.parked() == 0


def test_stat_all_works_in_a_forked_child(tmp_path, quick_idle, backend):
    """The parent's parked workers do not exist in a child; the child starts its own."""
    import signal

    stat_all([tmp_path] * 4)
    if backend == "pool":
        assert stat_pool._workers.parked() > 0
    else:
        assert uring._ring is not None, "the parent's ring exists, and the child must not use it"
    parents = uring._ring
    pid = os.fork()
    if pid == 0:  # child: a hang is killed by the alarm, not waited on forever
        signal.alarm(20)
        ok = all(isinstance(r, FileStat) for r in stat_all([tmp_path] * 4))
        os._exit(0 if ok and (backend == "pool" or uring._ring is not parents) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _thousand_shards(tmp_path):
    """A manifest of 1,000 one-byte shards, with the stats it would record at promotion."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = [f"model-{k + 1:05d}-of-01000.safetensors" for k in range(1000)]
    for name in names:
        (ckpt / name).write_bytes(b"x")
    (ckpt / "model.safetensors.index.json").write_text("{}")
    records = tuple(manifest_mod.ShardRecord(n, 1, "0" * 64, FileStat.of(ckpt / n)) for n in names)
    return ckpt, manifest_mod.Manifest(
        checkpoint=str(ckpt), digest="0" * 64, config_digest=None, shards=records,
        index_stat=FileStat.of(ckpt / "model.safetensors.index.json"), dir_stat=FileStat.of(ckpt),
        subdir_stats={})


@pytest.mark.parametrize("limit", [None, 64], ids=["one-round", "strided"])
def test_one_stale_shard_among_1000_is_caught(tmp_path, monkeypatch, request, quick_idle, backend, limit):
    if limit is not None:
        request.addfinalizer(uring.reset)  # later tests get a ring of the real size
        monkeypatch.setattr(filestat_mod, "MAX_STATS_IN_FLIGHT", limit)
        monkeypatch.setattr(uring, "MAX_ENTRIES", limit)
        uring.reset()  # the next ring has `limit` entries: waves of 64
    ckpt, man = _thousand_shards(tmp_path)
    # Control: the untouched checkpoint is not stale, so a hit below is the edit.
    assert manifest_mod.stale_reason(ckpt, man) is None
    victim = ckpt / man.shards[737].name
    st = os.stat(victim)
    with open(victim, "r+b") as f:  # in place, same size, mtime restored: only ctime tells
        f.write(b"y")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    reason, shard = manifest_mod.stale_reason(ckpt, man)
    assert shard == victim.name and "ctime_ns" in reason
    if backend == "uring" and limit is not None:
        assert uring._ring is not None and uring._ring.entries == limit, "control: the check ran in waves"


def test_a_thread_that_cannot_start_leaves_no_stat_undone(tmp_path, monkeypatch, quick_idle):
    """When the process runs out of threads part-way through starting
    workers, the remaining stats run in turn in the caller rather than never."""
    import _thread

    filestat_mod.stop_stat_workers()
    real_start = _thread.start_new_thread
    budget = [5]

    def scarce(fn, args):
        if budget[0] == 0:
            raise RuntimeError("can't start new thread")
        budget[0] -= 1
        return real_start(fn, args)

    monkeypatch.setattr(_thread, "start_new_thread", scarce)
    files = [tmp_path / f"f{i}" for i in range(20)]
    for i, f in enumerate(files):
        f.write_bytes(b"x" * i)
    out = stat_all(files)
    assert [r.size for r in out] == list(range(20))
    assert budget[0] == 0, "control: thread starts did run out part-way"


# -- the pool started before the check (plugin registration) -------------------------


def test_stat_workers_wanted_reads_the_env_and_names_it_when_bad():
    assert stat_pool.stat_workers_wanted({}) == 0
    assert stat_pool.stat_workers_wanted({stat_pool.STAT_WORKERS_ENV: " "}) == 0
    assert stat_pool.stat_workers_wanted({stat_pool.STAT_WORKERS_ENV: "1000"}) == 1000
    for bad in ("many", "-1", str(stat_pool.MAX_STATS_IN_FLIGHT + 1), "1e3"):
        with pytest.raises(ValueError, match=stat_pool.STAT_WORKERS_ENV):
            stat_pool.stat_workers_wanted({stat_pool.STAT_WORKERS_ENV: bad})


def test_prestarted_workers_serve_the_first_check_without_new_threads(tmp_path, monkeypatch, quick_idle):
    import _thread

    stat_pool.stop_stat_workers()
    assert stat_pool.prestart_stat_workers(0) is None
    thread = stat_pool.prestart_stat_workers(8, in_forks=False)
    thread.join(20)
    assert stat_pool._workers.parked() == 8
    started = []
    real_start = _thread.start_new_thread
    monkeypatch.setattr(_thread, "start_new_thread", lambda fn, args: (started.append(fn), real_start(fn, args))[1])
    assert all(isinstance(r, FileStat) for r in stat_all([tmp_path] * 8))
    assert started == [], "the first check after a prestart creates no thread"
    stat_all([tmp_path] * 9)
    assert len(started) == 1, "control: one stat more than the pool holds starts one thread"


def test_a_forked_child_of_a_prestarted_process_starts_its_own_pool(tmp_path, monkeypatch, quick_idle):
    """vLLM's fork-started workers do not re-run plugin registration."""
    import signal

    monkeypatch.setattr(stat_pool, "STAT_WORKER_IDLE_S", 30.0)
    monkeypatch.setattr(stat_pool, "_prestarted", 0)  # restored at teardown: later forks start nothing
    stat_pool.prestart_stat_workers(6).join(20)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        for _ in range(400):
            if stat_pool._workers.parked() >= 6:
                break
            threading.Event().wait(0.05)
        os.write(w, str(stat_pool._workers.parked()).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 64)
    os.waitpid(pid, 0)
    assert int(got) == 6


def test_prestarted_workers_pin_to_the_cpu_the_starter_runs_on(monkeypatch, quick_idle):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: there is nothing to pin to (the pool leaves affinity alone)")
    cpu = stat_pool._one_cpu()
    assert cpu is not None and cpu <= os.sched_getaffinity(0) and len(cpu) == 1
    seen = []
    stat_pool.stop_stat_workers()
    stat_pool.start_stat_workers(3)
    stat_pool.run([lambda: seen.append(os.sched_getaffinity(0))])
    for _ in range(200):
        if seen:
            break
        threading.Event().wait(0.05)
    assert len(seen[0]) == 1, "a prestarted worker runs on one CPU"
    stat_pool.stop_stat_workers()
    seen.clear()
    stat_pool.run([lambda: seen.append(os.sched_getaffinity(0))])
    for _ in range(200):
        if seen:
            break
        threading.Event().wait(0.05)
    assert seen[0] == os.sched_getaffinity(0), "control: a worker a check creates is not pinned"


def test_the_printed_fix_names_the_cache_the_engine_reads(promoted, monkeypatch):
    """A stale manifest in a non-default cache (promote --cache-dir DIR) names
    that cache in the command to run: the printed command, run as printed,
    is the one that makes the check pass again (field trial F1)."""
    import shlex
    import subprocess
    import sys

    from preload.identity.manifest import default_cache_dir, promote_command

    ckpt, cache, p = promoted
    monkeypatch.delenv("PRELOAD_GATE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.parent / "xdg"))
    shard = ckpt / p.manifest.shards[0].name
    with open(shard, "r+b") as f:
        f.seek(os.stat(shard).st_size - 1)
        f.write(b"\x01")
    with pytest.raises(StaleManifestError) as info:
        resolve_digest(ckpt, mode="stat", cache_dir=cache)
    fix = str(info.value).rsplit("run: ", 1)[1]
    assert fix == f"preload-gate promote {ckpt} --cache-dir {cache}"
    argv = shlex.split(fix)
    done = subprocess.run([sys.executable, "-m", "preload_gate.cli", *argv[1:], "--socket-root", str(cache / "s")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert resolve_digest(ckpt, mode="stat", cache_dir=cache).source == "manifest"
    # Control: the plain default cache needs no flag, and a path with a space is quoted.
    assert promote_command(ckpt, default_cache_dir(env=False)) == f"preload-gate promote {ckpt}"
    assert promote_command("/m/a b") == "preload-gate promote '/m/a b'"
