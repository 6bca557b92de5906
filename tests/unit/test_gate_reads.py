"""A promotion reads each checkpoint byte once: counted, not declared.

The promotion gate on a fresh checkpoint, its daemon and engines replaced by
stand-ins that read no weight byte (``fake_engines``: the daemon and the
cached engine take the digest from the promotion's manifest by the stat
check, as the real ones do), the golden's engine by a stub. Every read the
gate process makes of the weight shards is counted by
:class:`harness.bench.remote_fs.RemoteFS` (Python's file entry points,
patched for the block): the promotion hashes the shards once (its manifest
reads each shard's safetensors header first, before any weight byte: those
8 + N bytes are read twice), and the
gate's expectation, the daemon's digest, the verdict's independent digest
and the golden take that digest with its proof. Control: with the proof
refused (every use of a digest hashes, as the tree before did), the same
count is several times the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from fake_engines import FakeDaemon
from test_canary_golden import stub_result

from harness.bench.remote_fs import RemoteFS
from harness.gate import GateOptions, run_gate
from harness.targets.digests import Digests
from harness.targets.verified_cache import VerifiedCacheTarget
from harness.verdict import PASS
from preload.identity.digest import content_digest

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "manifests"))
    monkeypatch.setattr(VerifiedCacheTarget, "engine_worker", "fake_engines")
    monkeypatch.setattr(VerifiedCacheTarget, "reference_worker", "fake_engines")
    monkeypatch.setattr("harness.targets.verified_cache.DaemonProcess", FakeDaemon)
    monkeypatch.setattr("canaries.golden._run_worker", lambda spec, timeout_s, say=None: stub_result(len(spec["prompts"])))


def _promote_counted(tiny_ckpt: Path, tmp: Path, name: str):
    cand = tmp / name
    shutil.copytree(tiny_ckpt, cand)  # never promoted: no manifest yet
    shards = sorted(cand.glob("*.safetensors"))
    sock = tmp / f"sock-{name}"
    sock.mkdir(mode=0o700)
    with RemoteFS(shards) as fs:
        report = run_gate(GateOptions(candidate=str(cand), workdir=str(tmp / f"w-{name}"),
                                      reference_cache=str(tmp / f"refs-{name}"), report_dir=str(tmp / f"r-{name}"),
                                      socket_root=str(sock)))
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in shards)
    return report, fs.counts.bytes_read, sum(p.stat().st_size for p in shards), headers, cand


def test_a_promotion_reads_each_checkpoint_byte_once(tiny_ckpt, tmp_path, stand_ins):
    report, read, size, headers, cand = _promote_counted(tiny_ckpt, tmp_path, "cand")
    (case,) = report.cases
    assert report.verdict == PASS and case.verdict.outcome == "hit", (case.not_run_reason, report.error)
    assert report.golden["recorded"], report.golden
    assert read == size + headers, (read, size, headers)
    assert report.identity["hashed_bytes"] == size, report.identity
    assert report.identity["sources"] == {os.path.realpath(cand): "promoted"}
    # One digest, carried: the gate's, the daemon's, the verdict's and the golden's.
    digest = content_digest(cand)
    assert case.candidate_digest == case.daemon_digest == report.daemon["digest"] == digest
    assert json.loads(Path(report.golden["path"]).read_text())["digest"] == digest


def test_control_without_the_proof_every_use_hashes_again(tiny_ckpt, tmp_path, stand_ins, monkeypatch):
    monkeypatch.setattr(Digests, "_proven", lambda self, path: None)
    monkeypatch.setattr("canaries.golden._digest", content_digest)
    report, read, size, _, _ = _promote_counted(tiny_ckpt, tmp_path, "cand")
    assert report.verdict == PASS
    assert read >= 2 * size, (read, size)
