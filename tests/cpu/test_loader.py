"""The ``verified_cache`` loader against real vLLM CPU engines.

One module, shared daemons, few engines (each costs 30-60 s on 2 cores):

- ``auto`` baseline; cold start (no daemon, fallback on: one ``miss`` event
  naming "no daemon for this digest", disk load); warm start (daemon up,
  fallback off: ``hit``); restart (a second engine on the same daemon:
  ``hit``); all identical greedy tokens (5 prompts x 16 tokens, temperature 0).
- the restarted engine writes into a mapped weight; the daemon's copy, seen
  through a fresh attach, is bit-for-bit what it was.
- key mismatches with fallback off are startup failures naming the field:
  other content (no daemon for this digest), other dtype.
- a loaded-stage daemon whose checkpoint no longer hashes to its promoted
  digest refuses to start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from daemon_support import Daemon, copy_checkpoint, short_dir
from loader_support import run_engine

from pgbase.shards import shard_paths
from preload.client import DaemonClient
from preload.events import read_events
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="loader_engines")]

@pytest.fixture(scope="module")
def env(loader_env):
    return loader_env


@pytest.fixture(scope="module")
def auto(auto_tokens):
    return auto_tokens


def _extra(env, **kw):
    return {"socket_root": str(env["root"]), **kw}


def test_cold_start_is_one_loud_miss_and_same_tokens(env, auto, tmp_path):
    events = tmp_path / "events.jsonl"
    r = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache", extra=_extra(env))
    assert r["rc"] == 0, r["log"][-3000:]
    assert r["tokens"] == auto
    evs = read_events(events)
    assert len(evs) == 1, evs
    ev = evs[0]
    assert ev["outcome"] == "miss" and ev["source"] == "disk"
    assert "no daemon for this digest" in ev["reason"] and ev["fields"] == ["content_digest"]
    assert "preload-gate load:" in r["log"]


@pytest.fixture(scope="module")
def daemon(env):
    d = Daemon(env["ckpt"], env["root"], env["cache"], ("--stage", "loaded")).start(timeout=300)
    yield d
    d.stop()


def _snapshot(d: Daemon) -> dict[str, torch.Tensor]:
    from preload.identity.key import WeightCacheKey

    c = DaemonClient.connect(d.socket_dir, 0)
    try:
        key = WeightCacheKey.from_json(_daemon_key(d))
        att = c.get_state(key).attach()
        c.report_attach()  # a consumer that reads the tensors is a hit like any engine
        return {n: t.clone() for n, t in att.tensors.items()}
    finally:
        c.close()


def _daemon_key(d: Daemon) -> dict:
    """The daemon's own key, learned from a mismatch answer to a bogus key."""
    from pgbase.errors import CacheKeyMismatchError
    from preload.identity.key import WeightCacheKey

    c = DaemonClient.connect(d.socket_dir, 0)
    try:
        c.get_state(WeightCacheKey(content_digest="0" * 64))
    except CacheKeyMismatchError as exc:
        return exc.daemon_key  # type: ignore[attr-defined]
    finally:
        c.close()
    raise AssertionError("a bogus key was served")


def test_warm_start_hit_then_restart_hit_and_writes_stay_private(env, auto, daemon, tmp_path):
    events = tmp_path / "events.jsonl"
    warm = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                      extra=_extra(env, fallback=False))
    assert warm["rc"] == 0, warm["log"][-3000:]
    assert warm["tokens"] == auto
    before = _snapshot(daemon)
    # Restart: a second engine on the same daemon, which also writes into a mapped weight.
    victim = next(n for n in before if n.endswith("embed_tokens.weight"))
    restart = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                         extra=_extra(env, fallback=False), write_weight=victim)
    assert restart["rc"] == 0, restart["log"][-3000:]
    assert restart["tokens"] != auto  # control: the write reached the engine's own copy
    evs = read_events(events)
    assert [e["outcome"] for e in evs] == ["hit", "hit"]
    assert {e["digest"] for e in evs} == {e["daemon_digest"] for e in evs} == {daemon.ready["digest"]}
    assert evs[0]["tensors"] > 0 and evs[0]["bytes"] > 0
    after = _snapshot(daemon)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before), "the daemon's copy changed"
    stats = DaemonClient.connect(daemon.socket_dir, 0).stats()
    assert stats["hits"] >= 4  # 2 engines + 2 snapshots


def test_dtype_mismatch_without_fallback_fails_naming_dtype(env, daemon, tmp_path):
    events = tmp_path / "events.jsonl"
    r = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                   extra=_extra(env, fallback=False), dtype="float32")
    assert r["rc"] != 0
    assert "weight cache key mismatch on fields: dtype" in r["log"]
    evs = read_events(events)
    assert len(evs) == 1 and evs[0]["outcome"] == "miss" and evs[0]["fields"] == ["dtype"]


def test_other_content_without_fallback_fails_no_daemon_for_digest(env, daemon, tmp_path):
    other = copy_checkpoint(env["ckpt"], tmp_path / "other")
    shard = shard_paths(other)[0]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01  # same header, different weights
    shard.write_bytes(bytes(data))
    events = tmp_path / "events.jsonl"
    r = run_engine(other, env["cache"], events, load_format="verified_cache",
                   extra=_extra(env, fallback=False, identity="full"))
    assert r["rc"] != 0
    assert "no daemon for this digest" in r["log"]
    evs = read_events(events)
    assert len(evs) == 1 and evs[0]["outcome"] == "miss" and evs[0]["fields"] == ["content_digest"]
    assert evs[0]["digest"] != daemon.ready["digest"]


def test_loaded_daemon_refuses_bytes_that_changed_since_promotion(env, tmp_path):
    ckpt = copy_checkpoint(env["ckpt"], tmp_path / "ckpt")
    root = short_dir("pg-l2-")
    try:
        digest = promote(ckpt, socket_root=root, cache_dir=env["cache"]).digest
        shard = shard_paths(ckpt)[0]
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x10
        shard.write_bytes(bytes(data))
        # Pinned: without it the stale manifest (the write changed the stat) is refused before any read.
        d = Daemon(ckpt, root, env["cache"], ("--stage", "loaded", "--expect-digest", digest)).start(
            timeout=300, expect_ready=False)
        assert d.proc.returncode == 2
        assert f"differs from the manifest: {shard.name}" in d.output
        assert not list(Path(root).glob("*/*.sock"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_copy_mode_hit_then_release_runs_last(env, auto, daemon, tmp_path):
    """Copy mode clones and asks the daemon to release its arena, so this
    runs after every test that needs the daemon's arena."""
    events = tmp_path / "events.jsonl"
    r = run_engine(env["ckpt"], env["cache"], events, load_format="verified_cache",
                   extra=_extra(env, fallback=False, mode="copy"))
    assert r["rc"] == 0, r["log"][-3000:]
    assert r["tokens"] == auto
    assert [(e["outcome"], e["mode"]) for e in read_events(events)] == [("hit", "copy")]
    c = DaemonClient.connect(daemon.socket_dir, 0)
    try:
        assert c.get_memory() == 0 and c.stats()["released"] is True
    finally:
        c.close()
