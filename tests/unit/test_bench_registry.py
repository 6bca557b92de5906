"""The bench registry: with no --only every row that fits the machine runs,
a row whose hardware is missing reports "not run" without being called,
--skip-heavy leaves the heavy rows out, and --list says which are heavy."""

from __future__ import annotations

import pytest

import harness.bench as bench
from harness.bench import (
    BenchOptions,
    BenchResult,
    Figure,
    bench_row,
    load_rows,
    markdown,
    run_rows,
)
from preload_gate.cli import main

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_vllm")]


@pytest.fixture
def fake_rows(monkeypatch):
    """A registry of three fake rows (light CPU, heavy CPU, CUDA) that record their calls."""
    load_rows()  # the real modules are imported (and registered) before the swap
    monkeypatch.setattr(bench, "ROWS", {})
    called: list[str] = []

    def make(name: str):
        def fn(options: BenchOptions) -> list[BenchResult]:
            called.append(name)
            return [BenchResult(row=name, title=name, anchor=Figure("a", 2.0, "s"),
                                ours=Figure("o", 1.0, "s"), ratio=2.0, ratio_meaning="a / o")]
        return fn

    bench_row("light", "light row")(make("light"))
    bench_row("heavy", "heavy row", heavy="two engines")(make("heavy"))
    bench_row("cuda", "cuda row", needs="cuda")(make("cuda"))
    return called


def test_default_runs_every_row_that_fits(fake_rows, monkeypatch):
    monkeypatch.setattr(bench, "missing", lambda needs: "no CUDA device is visible" if needs else None)
    results = run_rows(BenchOptions())
    assert fake_rows == ["light", "heavy"], "the CUDA row is not called without CUDA"
    by_row = {r.row: r for r in results}
    assert by_row["cuda"].not_run == "no CUDA device is visible" and by_row["cuda"].ratio is None
    assert by_row["light"].not_run is None
    assert "| cuda row | not run | not run | n/a |" in markdown(results)


def test_cuda_row_runs_where_cuda_is(fake_rows, monkeypatch):
    """Control: the not-run above is the machine check, not the row being dropped."""
    monkeypatch.setattr(bench, "missing", lambda needs: None)
    run_rows(BenchOptions())
    assert fake_rows == ["light", "heavy", "cuda"]


def test_a_cuda_row_called_directly_reports_not_run_without_cuda(fake_rows, monkeypatch):
    """The registered function itself checks its need (a caller other than
    run_rows gets "not run" too); control: with CUDA it runs the body."""
    row = bench.ROWS["cuda"].run
    monkeypatch.setattr(bench, "missing", lambda needs: "no CUDA device is visible" if needs else None)
    (result,) = row(BenchOptions())
    assert result.not_run == "no CUDA device is visible" and result.title == "cuda row"
    assert fake_rows == []
    monkeypatch.setattr(bench, "missing", lambda needs: None)
    assert row(BenchOptions())[0].not_run is None and fake_rows == ["cuda"]


def test_the_real_gpu_rows_report_not_run_on_this_machine(monkeypatch):
    """The GPU rows keep no check of their own: the registry's is the one."""
    rows = load_rows()
    monkeypatch.setattr(bench, "missing", lambda needs: "no CUDA device is visible" if needs else None)
    cuda_rows = [r for r in rows.values() if r.needs == "cuda"]
    assert {r.name for r in cuda_rows} == {"gpu_attach", "gpu_checksum", "gpu_daemon_attach", "gpu_readopt", "gpu_restart"}
    for r in cuda_rows:
        (result,) = r.run(BenchOptions())
        assert result.row == r.name and result.not_run == "no CUDA device is visible"


def test_skip_heavy(fake_rows, monkeypatch):
    monkeypatch.setattr(bench, "missing", lambda needs: None)
    results = run_rows(BenchOptions(), skip_heavy=True)
    assert fake_rows == ["light", "cuda"]
    assert "skipped by --skip-heavy" in next(r for r in results if r.row == "heavy").notes
    # Named explicitly, a heavy row runs.
    run_rows(BenchOptions(), ["heavy"], skip_heavy=True)
    assert fake_rows[-1] == "heavy"


def test_bad_needs_is_refused():
    with pytest.raises(bench.BenchError, match="needs 'tpu'"):
        bench_row("x", "x", needs="tpu")


def test_list_names_heavy_rows_and_needs(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    blocks: dict[str, str] = {}
    row = ""
    for line in out.splitlines():
        if line.startswith(" "):
            blocks[row] += line
        else:
            row = line.split()[0]
            blocks[row] = ""
    heavy = {name for name, extra in blocks.items() if "heavy:" in extra}
    assert {"daemon_weight_load", "gate_selftest", "promote_throughput"} <= heavy
    assert "restart_identity" not in heavy and "restart_identity" in blocks
    assert out.count("needs cuda") == 5


def test_skip_heavy_with_only_is_refused(capsys):
    assert main(["bench", "--only", "restart_identity", "--skip-heavy"]) == 2
    assert "--skip-heavy" in capsys.readouterr().err
