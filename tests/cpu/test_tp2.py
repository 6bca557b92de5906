"""TP=2 on CPU: two daemon ranks (a gloo group on loopback, one core each)
serve two engine ranks; a TP=1 engine against them names the TP fields."""

from __future__ import annotations

import pytest
from daemon_support import Daemon
from loader_support import run_engine

from preload.events import read_events

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(name="loader_engines")]

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def tp2_daemon(loader_env):
    d = Daemon(loader_env["ckpt"], loader_env["root"], loader_env["cache"],
               ("--stage", "loaded", "-tp", "2")).start(timeout=400)
    yield d
    d.stop()


def test_tp2_daemon_places_two_ranks(tp2_daemon):
    ranks = tp2_daemon.ready["ranks"]
    assert [(r["global_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (1, 1)]
    assert len({r["pid"] for r in ranks}) == 2
    assert len({r["digest"] for r in ranks}) == 1


def test_tp2_warm_hit_identical_tokens(loader_env, tp2_daemon, tmp_path):
    auto = run_engine(loader_env["ckpt"], loader_env["cache"], tp=2, env_extra=TP2_ENV)
    assert auto["rc"] == 0, auto["log"][-3000:]
    events = tmp_path / "events.jsonl"
    cached = run_engine(loader_env["ckpt"], loader_env["cache"], events, tp=2, env_extra=TP2_ENV,
                        load_format="verified_cache",
                        extra={"socket_root": str(loader_env["root"]), "fallback": False})
    assert cached["rc"] == 0, cached["log"][-3000:]
    assert cached["tokens"] == auto["tokens"]
    evs = sorted(read_events(events), key=lambda e: e["rank"])
    assert [(e["outcome"], e["rank"]) for e in evs] == [("hit", 0), ("hit", 1)]


def test_tp1_engine_against_tp2_daemon_names_tp_size(loader_env, tp2_daemon, tmp_path):
    events = tmp_path / "events.jsonl"
    r = run_engine(loader_env["ckpt"], loader_env["cache"], events, load_format="verified_cache",
                   extra={"socket_root": str(loader_env["root"]), "fallback": False})
    assert r["rc"] != 0
    assert "weight cache key mismatch on fields: tp_size" in r["log"]
    evs = read_events(events)
    assert len(evs) == 1 and evs[0]["fields"] == ["tp_size"]
