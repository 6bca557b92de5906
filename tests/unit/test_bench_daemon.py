"""daemon_weight_load's assembly, without engines: three figures (weight
load, ready, first token) from the same two runs, each auto beside
verified_cache with its ratio; a miss or differing tokens void the row.
The engines themselves run in the bench (one smoke run), not here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import harness.bench.daemon as daemon_row
from harness.bench import BenchError, BenchOptions
from harness.engine import EngineResult

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_vllm")]


class _FakeDaemon:
    def __init__(self, *args: object) -> None:
        self.ready = {"ranks": [{"load_seconds": 0.05}]}
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def _fake(monkeypatch, tmp_path, outcome="hit", cached_tokens=((1, 2, 3),)):
    calls = []

    def run_engine(spec, workdir, timeout_s, worker):
        calls.append((spec.load_format, worker))
        wd = Path(workdir)
        wd.mkdir(parents=True, exist_ok=True)
        cached = spec.load_format == "verified_cache"
        (wd / "engine.log").write_text(f"x\nPG_WEIGHT_LOAD_SECONDS {0.5 if cached else 2.0}\ny\n")
        return EngineResult(
            ok=True, token_ids=[list(t) for t in (cached_tokens if cached else ((1, 2, 3),))],
            timings={"imported": 8.0, "ready": 10.0 if cached else 15.0, "first_token": 10.5 if cached else 16.0, "wall": 1},
            events=[{"outcome": outcome, "seconds": 0.4, "bytes": 10, "tensors": 2}] if cached else [],
        )

    monkeypatch.setattr(daemon_row, "run_engine", run_engine)
    monkeypatch.setattr(daemon_row, "_Daemon", _FakeDaemon)
    monkeypatch.setattr(daemon_row, "_checkpoint", lambda options, work: work)
    monkeypatch.setattr(importlib.import_module("preload.promote"), "promote", lambda *a, **k: None)
    return calls


def test_three_figures_from_one_pair_of_runs(monkeypatch, tmp_path):
    calls = _fake(monkeypatch, tmp_path)
    results = daemon_row.daemon_weight_load(BenchOptions(workdir=tmp_path))
    assert calls == [("auto", "harness.bench.daemon"), ("verified_cache", "harness.bench.daemon")]
    by = {r.title.split(" (")[0]: r for r in results}
    assert set(by) == {"weight-load phase", "engine ready", "time to first token"}
    assert by["weight-load phase"].ratio == pytest.approx(4.0)
    assert by["engine ready"].ratio == pytest.approx(1.5)
    assert by["time to first token"].anchor.value == 16.0 and by["time to first token"].ours.value == 10.5
    assert all(r.anchor.label == "auto" and r.ours.label == "verified_cache hit" for r in results)
    table = results[0].details["table"]
    assert table[2]["ratio"] == "1.52x" and table[3]["ratio"] == "3.50x"  # (15-8) / (10-8)
    assert not list(tmp_path.iterdir()), "scratch is removed"


@pytest.mark.parametrize("outcome,tokens", [("miss", ((1, 2, 3),)), ("hit", ((1, 2, 4),))])
def test_a_miss_or_different_tokens_voids_the_row(monkeypatch, tmp_path, outcome, tokens):
    """Control for the above: the figures are only reported for a hit with identical tokens."""
    _fake(monkeypatch, tmp_path, outcome=outcome, cached_tokens=tokens)
    with pytest.raises(BenchError, match="did not hit with identical tokens"):
        daemon_row.daemon_weight_load(BenchOptions(workdir=tmp_path))


def test_missing_load_line_is_an_error(monkeypatch, tmp_path):
    _fake(monkeypatch, tmp_path)
    real = daemon_row.run_engine

    def no_line(spec, workdir, timeout_s, worker):
        r = real(spec, workdir, timeout_s, worker)
        (Path(workdir) / "engine.log").write_text("nothing timed\n")
        return r

    monkeypatch.setattr(daemon_row, "run_engine", no_line)
    with pytest.raises(BenchError, match="PG_WEIGHT_LOAD_SECONDS"):
        daemon_row.daemon_weight_load(BenchOptions(workdir=tmp_path))
