"""Restart identity: one concurrent round of stats; a stale manifest is a named miss.

- An unchanged manifest resolves with stats only (no open, no read).
- A stale manifest (an edit whose mtime was restored; a new
  ``consolidated.safetensors`` that switches vLLM's file set) or a missing
  one is a StaleManifestError naming the shard and ``preload-gate promote``;
  the checkpoint is not opened (the shim counts opens and reads) and the
  manifest's bytes are unchanged (nothing re-hashed, nothing rewritten).
- Stats are issued concurrently: a barrier that every stat must reach
  before any returns passes; the control (the same stats one after another)
  breaks it.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from fixtures.mutations import copy_checkpoint
from harness.bench.remote_fs import RemoteFS
from preload.identity import anchors
from preload.identity import manifest as manifest_mod
from preload.identity.manifest import (
    FileStat,
    StaleManifestError,
    manifest_path,
    resolve_digest,
    stat_all,
)
from preload.promote import promote

pytestmark = pytest.mark.unit


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
    assert "added, removed or renamed" in str(err) and err.shard is None
    assert counts.opens == 0 and after == before


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


def test_in_flight_stats_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_mod, "MAX_STATS_IN_FLIGHT", 3)
    files = [tmp_path / f"f{i}" for i in range(20)]
    for f in files:
        f.write_bytes(b"x")
    lock, now, peak = threading.Lock(), [0], [0]
    real = FileStat.of.__func__

    def counted(cls, path):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            threading.Event().wait(0.01)
            return real(cls, path)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(FileStat, "of", classmethod(counted))
    assert len(stat_all(files)) == 20
    assert 1 <= peak[0] <= 3
