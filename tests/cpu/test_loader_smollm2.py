"""The upstream scenario on a real model: SmolLM2-135M, ``auto`` versus a
warm ``verified_cache`` hit, identical greedy tokens (slow: ~270 MB bf16)."""

from __future__ import annotations

import shutil

import pytest
from daemon_support import Daemon, short_dir
from loader_support import run_engine

from preload.events import read_events
from preload.promote import promote

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="loader_engines")]


def test_smollm2_warm_hit_matches_auto(smollm2_ckpt, tmp_path):
    root, cache = short_dir("pg-s-"), tmp_path / "cache"
    try:
        promote(smollm2_ckpt, socket_root=root, cache_dir=cache)
        auto = run_engine(smollm2_ckpt, cache)
        assert auto["rc"] == 0, auto["log"][-3000:]
        daemon = Daemon(smollm2_ckpt, root, cache, ("--stage", "loaded")).start(timeout=600)
        try:
            events = tmp_path / "events.jsonl"
            cached = run_engine(smollm2_ckpt, cache, events, load_format="verified_cache",
                                extra={"socket_root": str(root), "fallback": False})
            assert cached["rc"] == 0, cached["log"][-3000:]
            assert cached["tokens"] == auto["tokens"]
            assert [e["outcome"] for e in read_events(events)] == ["hit"]
            rank = daemon.ready["ranks"][0]
            # Peak growth while loading stays near the weight bytes (no second copy).
            assert rank["peak_rss_bytes"] - rank["baseline_rss_bytes"] < 1.5 * rank["bytes"]
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
