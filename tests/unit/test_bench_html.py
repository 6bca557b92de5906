"""bench.html: drawn from a recorded bench result, self-contained, escaped.

The checks here are structural (what the page contains), never timing. Each
check that something is absent has a control showing it finds the thing
when it is there.
"""

from __future__ import annotations

import json
import re

import pytest

from harness.bench import BenchError, BenchResult, Figure, not_run
from harness.bench.html import BAR_W, chart, render, write_html

pytestmark = pytest.mark.unit

HOSTILE = '<script>alert("x")</script>'


def external_refs(page: str) -> list[str]:
    """Anything that would make the page fetch or run something: script,
    src/href attributes, stylesheets, CSS url()/@import, absolute URLs."""
    pattern = r"<script|<link|<iframe|<object|<embed|\ssrc\s*=|\shref\s*=|url\(|@import|https?://|//[a-z0-9.-]+\.[a-z]{2,}/"
    return re.findall(pattern, page, flags=re.I)


def recorded_results() -> list[BenchResult]:
    """Results as bench.json stores them, read back (the 'recorded' path)."""
    table = [{"scheme": "header_only", "opens": 67, "wall_s": 10.3},
             {"scheme": f"content/stat {HOSTILE}", "opens": 0, "wall_s": 3.6}]
    results = [
        BenchResult(row="restart_identity", title=f"restart identity {HOSTILE}",
                    anchor=Figure("header_only (67 opens) & co", 10.0, "s"),
                    ours=Figure("content/stat (0 opens)", 2.5, "s"), ratio=4.0,
                    ratio_meaning="anchor wall / ours wall", target="content/stat opens no shard",
                    details={"table": table}, notes="opens and reads 50 ms each"),
        BenchResult(row="daemon_weight_load", title="time to first token (tiny, CPU)",
                    anchor=Figure("auto", 1.0, "s"), ours=Figure("verified_cache hit", 4.0, "s"),
                    ratio=0.25, ratio_meaning="auto / verified_cache"),
        not_run("gpu_attach", "attach over CUDA IPC", "no CUDA device is visible"),
    ]
    doc = json.loads(json.dumps({"results": [r.to_json() for r in results]}))
    return [BenchResult.from_json(r) for r in doc["results"]]


def test_page_is_self_contained(tmp_path):
    page = write_html(recorded_results(), tmp_path / "bench.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert external_refs(page) == []
    # Control: the check finds each kind of outside reference.
    for bad in ('<img src="https://cdn.example/x.png">', '<link rel="stylesheet" href="a.css">',
                "<script>1</script>", "<style>body{background:url(x.png)}</style>", "@import 'a.css';"):
        assert external_refs(page.replace("</body>", bad + "</body>")), bad


def test_text_from_results_is_escaped():
    page = render(recorded_results())
    assert "&lt;script&gt;alert(" in page, "the hostile title and table cell appear, escaped"
    assert "<script>" not in page and "&amp; co" in page
    # Control: the same check catches a page that pastes the text raw.
    naive = page.replace("</body>", f"<p>{HOSTILE}</p></body>")
    assert "<script>" in naive and external_refs(naive)


def test_one_chart_per_result_with_anchor_ours_and_ratio():
    results = recorded_results()
    page = render(results)
    # One SVG per result that ran; the not-run row says why and draws nothing.
    assert page.count("<svg") == 2
    assert "not run: no CUDA device is visible" in page
    assert "4.00x (anchor wall / ours wall)" in page and "0.25x (auto / verified_cache)" in page
    assert page.count('class="anchor"') == 2 and page.count('class="ours"') == 2
    # The table lists every result and the raw measurements once.
    assert page.count("<h2>restart_identity: raw measurements</h2>") == 1
    assert "content/stat (0 opens): 2.5 s" in page


def test_bars_share_a_scale_per_result():
    r1, r2, nr = (chart(r) for r in recorded_results())
    anchor, ours = r1.bars
    assert anchor.width == BAR_W and ours.width == pytest.approx(BAR_W / 4, abs=0.1)
    anchor, ours = r2.bars  # ours is the longer one here: it spans the chart
    assert ours.width == BAR_W and anchor.width == pytest.approx(BAR_W / 4, abs=0.1)
    assert nr.not_run == "no CUDA device is visible"


def test_malformed_recorded_result_is_one_clear_error():
    with pytest.raises(BenchError, match="malformed"):
        BenchResult.from_json({"row": "x", "title": "t"})
