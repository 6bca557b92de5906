"""The content digest is what coreutils prints, and what each restart mode resolves."""

from __future__ import annotations

import os
import subprocess

import pytest

from fixtures.mutations import by_name, copy_checkpoint
from harness.bench.remote_fs import RemoteFS
from preload.identity import anchors
from preload.identity.manifest import StaleManifestError, resolve_digest
from preload.promote import promote

pytestmark = pytest.mark.unit


def _coreutils_digest(ckpt) -> str:
    proc = subprocess.run(
        "LC_ALL=C sha256sum *.safetensors | sha256sum",
        shell=True, cwd=ckpt, capture_output=True, text=True, check=True,
    )
    return proc.stdout.split()[0]


@pytest.mark.parametrize("shards", [1, 2, 5])
def test_digest_equals_sha256sum_pipeline(shards, tiny_checkpoint):
    ckpt = tiny_checkpoint(shards=shards)
    assert anchors.content(ckpt).hex == _coreutils_digest(ckpt)


def test_digest_equals_sha256sum_on_an_edit(tiny_ckpt, tmp_path):
    """Control: the equality is not vacuous; an edit moves both sides together."""
    row = by_name("single_element")
    cand = row.apply(row.stage(tiny_ckpt, tmp_path), tmp_path)
    assert anchors.content(cand).hex == _coreutils_digest(cand) != _coreutils_digest(tiny_ckpt)


@pytest.fixture
def promoted(tiny_checkpoint, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoint(shards=2), tmp_path / "ckpt")
    cache = tmp_path / "cache"
    p = promote(ckpt, socket_root=tmp_path / "sock", cache_dir=cache, progress=False)
    return ckpt, cache, p.digest


def test_stat_mode_trusts_an_unchanged_manifest_without_opening_a_shard(promoted):
    ckpt, cache, digest = promoted
    with RemoteFS([ckpt]) as fs:
        res = resolve_digest(ckpt, mode="stat", cache_dir=cache)
    assert (res.digest, res.source) == (digest, "manifest")
    assert fs.counts.opens == 0 and fs.counts.reads == 0
    assert fs.counts.stats >= 2  # one per shard at least: the shim does see this scheme's I/O


def test_stat_mode_sees_an_edit_whose_mtime_was_restored(promoted):
    ckpt, cache, digest = promoted
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 2)
        f.write(b"\x3f\x80")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_mtime_ns == st.st_mtime_ns and os.stat(shard).st_size == st.st_size
    with pytest.raises(StaleManifestError, match="ctime_ns") as info:
        resolve_digest(ckpt, mode="stat", cache_dir=cache)
    assert info.value.shard == shard.name and "preload-gate promote" in str(info.value)
    assert resolve_digest(ckpt, mode="full").digest == _coreutils_digest(ckpt) != digest
    # path_stat, the anchor, is fooled by the same edit.
    assert by_name("inplace_mtime_restored").expected["path_stat"] is True


def test_pinned_mode_does_no_checkpoint_io(promoted):
    ckpt, cache, digest = promoted
    with RemoteFS([ckpt, cache]) as fs:
        res = resolve_digest(ckpt, mode="pinned", expected_digest=digest, cache_dir=cache)
    assert res.digest == digest and res.source == "pinned"
    assert fs.counts.touched == 0


def test_full_mode_rehashes_every_shard(promoted):
    ckpt, cache, digest = promoted
    with RemoteFS([ckpt]) as fs:
        res = resolve_digest(ckpt, mode="full", cache_dir=cache)
    assert res.digest == digest and res.source == "rehashed"
    shard_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert fs.counts.opens >= 2 and fs.counts.bytes_read >= shard_bytes
