"""The demo's two lanes: daemon targets on one core, vLLM's caches on the other, side by side."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

import harness.demo as demo
from harness.engine import CorePool, EngineSpec

pytestmark = pytest.mark.unit


def test_plan_lanes_splits_by_kind_only_with_two_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the demo runs one lane")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    assert demo.plan_lanes(demo.DEMO_TARGETS, 2, False) == [
        (("verified_cache", "header_only"), 1, (a,)),
        (("sharded_state", "npcache", "ipc_cache", "fastsafetensors", "instanttensor", "runai_streamer",
          "tensorizer"), 1, (b,))]
    # Controls: one job, a TP=2 run (both cores per engine), or one kind: one lane as before.
    for args in ((demo.DEMO_TARGETS, 1, False), (demo.DEMO_TARGETS, 2, True), (("npcache", "ipc_cache"), 2, False)):
        assert demo.plan_lanes(*args) == [(args[0], args[1], None)]


def test_a_pool_given_cores_binds_even_one_engine():
    spec = EngineSpec(checkpoint="/x")
    with CorePool(1, cores=(1,)).pinned(spec) as s:
        assert s.env.get("VLLM_CPU_OMP_THREADS_BIND") == "1"
    with CorePool(1).pinned(spec) as s:
        assert "VLLM_CPU_OMP_THREADS_BIND" not in s.env, "control: one job, no cores given, vLLM's default"


def test_the_lanes_run_side_by_side_and_the_matrix_keeps_the_target_order(tmp_path, monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the demo runs one lane")
    both_running = threading.Barrier(2, timeout=30)
    seen: list[tuple[str, int, tuple[int, ...] | None]] = []

    def fake_gate(opts):
        seen.append((opts.target, opts.jobs, opts.cores))
        if opts.target in ("verified_cache", "sharded_state"):
            both_running.wait()  # each lane's first target waits for the other: they overlap
        doc = {"target": opts.target, "verdict": "PASS", "exit_code": 0}
        return SimpleNamespace(to_json=lambda: doc, seconds=0.0)

    built = {}
    monkeypatch.setattr(demo, "run_gate", fake_gate)
    monkeypatch.setattr(demo, "write_reports", lambda doc, out: None)
    def fake_matrix(reports, **kw):
        built["order"], built["timings"] = [r["target"] for r in reports], list(kw["timings"])

    monkeypatch.setattr(demo, "build_matrix", fake_matrix)
    monkeypatch.setattr(demo, "render_matrix_html", lambda m: "")
    monkeypatch.setattr(demo, "print_matrix", lambda m: None)
    (tmp_path / "w" / "tiny").mkdir(parents=True)
    (tmp_path / "w" / "tiny" / "config.json").write_text("{}")
    rc = demo.run_demo(model="tiny", report_dir=str(tmp_path / "r"), workdir=str(tmp_path / "w"), jobs=2)
    assert rc == 0
    assert built["order"] == list(demo.DEMO_TARGETS)
    assert built["timings"] == [*demo.DEMO_TARGETS, "total"]
    assert {t: (j, c is not None and len(c) == 1) for t, j, c in seen} == {t: (1, True) for t in demo.DEMO_TARGETS}
    assert len({c for t, _, c in seen if t in demo.DAEMON_TARGETS}) == 1
    assert {c for t, _, c in seen if t in demo.DAEMON_TARGETS}.isdisjoint(
        {c for t, _, c in seen if t not in demo.DAEMON_TARGETS}), "one core per lane"
