"""Case preparation without engines: candidates, independent digests, engine specs."""

from __future__ import annotations

from pathlib import Path

import pytest
from gate_cases import prepare

from harness.gate import GateOptions, content_digest
from harness.mutations import select_cases
from preload.identity.manifest import StaleManifestError, resolve_digest

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch):
    monkeypatch.setattr("harness.gate.fingerprints.HEADER_IMPL", "reimpl")


def _prep(name: str, tiny: Path, tmp: Path, **kw):
    (case,) = select_cases(name)
    base_digest = content_digest(tiny)
    opts = GateOptions(candidate=str(tiny), mutations=name, **kw)
    sock = tmp / "sock"
    sock.mkdir(mode=0o700, parents=True)
    return prepare(opts, case, base_digest, tmp / "work", str(sock))[1], base_digest


def test_inplace_mtime_restored_is_seen_by_the_stat_check(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    p, base_digest = _prep("inplace_mtime_restored", tiny_ckpt, tmp_path)
    r = p.result
    assert r.candidate_digest != base_digest and r.daemon_digest == base_digest
    # Same path, same size and mtime: path_stat and realpath are fooled, content is not.
    assert r.fingerprints["path_stat"]["equal"] and r.fingerprints["realpath"]["equal"]
    assert r.fingerprints["content"]["equal"] is False
    # The staged copy was promoted before the overwrite; the engine's stat check
    # sees it stale and names the shard (a miss; engines never re-hash).
    with pytest.raises(StaleManifestError, match="ctime_ns"):
        resolve_digest(r.candidate, mode="stat")
    assert resolve_digest(r.candidate, mode="full").digest == r.candidate_digest
    spec = p.cached_spec
    assert spec.load_format == "verified_cache"
    assert spec.extra_config["fallback"] is True and spec.extra_config["identity"] == "stat"
    assert Path(tiny_ckpt).exists() and content_digest(tiny_ckpt) == base_digest  # base untouched


def test_hit_case_turns_fallback_off_and_controls_reach_the_loader(tiny_ckpt, tmp_path):
    p, base_digest = _prep("identical_copy", tiny_ckpt, tmp_path, unsafe_identity="header_only",
                           unsafe_silent_fallback=True)
    assert p.result.candidate_digest == base_digest and p.case.expect == "hit"
    extra = p.cached_spec.extra_config
    assert extra["fallback"] is False
    assert extra["unsafe_identity"] == "header_only" and extra["unsafe_silent_fallback"] is True
    assert p.reference_spec.load_format == "auto" and p.reference_spec.extra_config is None


def test_not_run_cases_still_get_their_key_check(tiny_ckpt, tmp_path):
    tp, _ = _prep("tp_shift", tiny_ckpt, tmp_path / "x")
    assert tp.result.status == "NOT_RUN" and tp.result.key_check["mismatched_fields"] == ["tp_size"]
    assert "--run-tp" in tp.result.not_run_reason and tp.cached_spec is None
    tp_run, _ = _prep("tp_shift", tiny_ckpt, tmp_path / "y", run_tp=True)
    # prepared to run, still NOT_RUN until judged
    assert tp_run.result.status == "NOT_RUN" and tp_run.cached_spec.tensor_parallel_size == 2
    assert tp_run.result.expect == "miss"
