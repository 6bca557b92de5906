"""What a rollout tells people and machines: the load generator's counts, the
report (JSON, Markdown, HTML timeline) and the Prometheus textfile (no vLLM)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollout_support import FakeReplica, golden

from harness.rollout.loadgen import LoadGenerator, LoadGenError
from harness.rollout.metrics import RolloutMetrics
from harness.rollout.report import (
    build,
    headline,
    render_html,
    render_markdown,
    timeline,
    write_report,
)
from harness.rollout.state import Checkpoint, ReplicaRecord, RolloutState

pytestmark = pytest.mark.unit

A, B, C = "a" * 64, "b" * 64, "c" * 64


@pytest.fixture
def fakes():
    made = [FakeReplica() for _ in range(3)]
    yield made
    for f in made:
        f.close()


def _run(gen: LoadGenerator, until: int = 20, limit_s: float = 10.0) -> dict:
    gen.start()
    end = time.monotonic() + limit_s
    while sum(gen.snapshot().values()) < until and time.monotonic() < end:
        time.sleep(0.05)
    return gen.stop().to_json()


def test_answers_are_counted_by_the_checkpoint_they_match(fakes) -> None:
    ga, gb = golden(1, A), golden(2, B)
    fakes[0].serving, fakes[1].serving = ga, gb
    counts = _run(LoadGenerator([fakes[0].url, fakes[1].url], {"A": ga, "B": gb}, rate=100))
    assert counts["wrong"] == 0 and counts["refused"] == 0 and counts["answered"] >= 20
    assert set(counts["by_checkpoint"]) == {"A", "B"}


def test_an_answer_matching_no_golden_is_wrong(fakes) -> None:
    """The control of the count above: a replica serving weights nobody rolled out."""
    ga, gb = golden(1, A), golden(2, B)
    fakes[0].serving = golden(3, C)
    counts = _run(LoadGenerator([fakes[0].url], {"A": ga, "B": gb}, rate=100))
    assert counts["wrong"] >= 1 and counts["answered"] == 0 and counts["wrong_examples"][0]["replica"] == fakes[0].url


def test_a_restarting_replica_is_refused_not_wrong(fakes) -> None:
    ga = golden(1, A)
    fakes[0].serving = None  # 503 while it starts
    counts = _run(LoadGenerator([fakes[0].url], {"A": ga}), until=3)
    assert counts["refused"] >= 3 and counts["wrong"] == 0 and counts["answered"] == 0


def test_a_near_tie_is_answered_and_counted_apart(fakes) -> None:
    g = golden(1, A, ties=True)
    fakes[0].serving, fakes[0].tie_flip = g, True
    counts = _run(LoadGenerator([fakes[0].url], {"A": g}, rate=100))
    assert counts["wrong"] == 0 and counts["near_ties"] == counts["answered"] > 0


def test_goldens_of_other_prompts_cannot_be_judged_together() -> None:
    from dataclasses import replace

    ga = golden(1, A)
    gb = replace(golden(2, B), prompts=golden(2, B).prompts[:2])
    with pytest.raises(LoadGenError, match="ask different prompts"):
        LoadGenerator(["http://127.0.0.1:9"], {"A": ga, "B": gb})


def _finished_state(tmp: Path) -> RolloutState:
    recs = [ReplicaRecord(i, f"http://127.0.0.1:{9000 + i}", str(tmp / f"r{i}.jsonl")) for i in range(2)]
    s = RolloutState.new([Checkpoint("/m/A", A), Checkpoint("/m/B", B)], recs, {}, [], {"kind": "supervised"})
    t = s.created
    s.timeline = [
        {"t": t, "replica": 0, "phase": "serving", "serving": A}, {"t": t, "replica": 1, "phase": "serving", "serving": A},
        {"t": t + 10, "replica": 0, "phase": "switching", "serving": A, "target": B},
        {"t": t + 40, "replica": 0, "phase": "serving", "serving": B},
        {"t": t + 40, "replica": 1, "phase": "switching", "serving": A, "target": B},
        {"t": t + 70, "replica": 1, "phase": "rolling_back", "serving": None, "target": A},
        {"t": t + 95, "replica": 1, "phase": "serving", "serving": A},
    ]
    s.updated = t + 100
    s.status = "failed"
    s.failure = {"replica": 1, "url": recs[1].url, "onto": "B", "reason": "canary_failed", "detail": "canary token_mismatch",
                 "rollback": {"ok": True, "hit": True}, "fleet_back_on_from": False, "fleet": "NOT all replicas ..."}
    s.switches = [{"replica": 0, "onto": "B", "ok": True, "reason": "", "detail": "match", "rollback": False,
                   "seconds": {"restart": 1.0, "ready": 25.0, "canary": 0.5, "switch": 26.5}}]
    return s


def test_timeline_spans_say_what_each_replica_served(tmp_path: Path) -> None:
    spans = timeline(_finished_state(tmp_path))
    assert [(x["serving"], x["start"], x["end"]) for x in spans[0]["spans"]] == [
        ("A", 0, 10), ("nothing", 10, 40), ("B", 40, 100)]
    assert [x["serving"] for x in spans[1]["spans"]] == ["A", "nothing", "A"]
    assert spans[1]["spans"][1] == {"serving": "nothing", "start": 40, "end": 95}


def test_report_names_the_replica_the_reason_and_the_hit(tmp_path: Path) -> None:
    s = _finished_state(tmp_path)
    doc = build(s, {"answered": 10, "refused": 2, "wrong": 0, "near_ties": 0, "by_checkpoint": {"A": 10},
                    "by_replica": {}, "refused_reasons": {}, "wrong_examples": [], "seconds": 90.0})
    line = headline(doc)
    assert line.startswith("FAILED: replica 1 (http://127.0.0.1:9001) on B: canary_failed")
    assert "replica 1 is back on A as a hit" in line
    md = render_markdown(doc)
    assert "**wrong 0**" in md and "| 0 | B |  | ok |" in md
    html = render_html(doc)
    assert "<svg" in html and "replica 1" in html and 'fill="#0969da"' in html  # B's color in the timeline
    paths = write_report(doc, tmp_path / "out")
    assert all(p.stat().st_size > 0 for p in paths.values())


def test_metrics_textfile_parses_and_says_the_phase_of_each_replica(tmp_path: Path) -> None:
    s = _finished_state(tmp_path)
    s.replicas[0].phase, s.replicas[0].serving = "serving", B
    s.replicas[1].phase, s.replicas[1].serving = "switching", A
    m = RolloutMetrics(tmp_path / "rollout.prom")
    m.update(s)
    m.record_switch(s.switches[0])
    m.record_switch({"ok": False, "reason": "miss", "seconds": {"restart": 2.0}})
    m.record_requests({"answered": 5, "refused": 1, "wrong": 0})
    m.record_requests({"answered": 7, "refused": 1, "wrong": 0})
    m.write()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for f in text_string_to_metric_families((tmp_path / "rollout.prom").read_text()) for x in f.samples}
    assert samples[("preload_gate_rollout_status", (("status", "failed"),))] == 1
    assert samples[("preload_gate_rollout_replica_phase", (("phase", "switching"), ("replica", "1")))] == 1
    assert samples[("preload_gate_rollout_replica_serving", (("checkpoint", "B"), ("digest", B[:16]), ("replica", "0")))] == 1
    assert samples[("preload_gate_rollout_switches_total", (("outcome", "miss"),))] == 1
    assert samples[("preload_gate_rollout_requests_total", (("outcome", "answered"),))] == 7
    assert samples[("preload_gate_rollout_switch_seconds_count", (("phase", "ready"),))] == 1
