"""The demo's cross-target matrix: terminal table, HTML page, headless Chromium.

The sample is built from the per-target report fixture of test_report, so
the matrix is derived from real report.json shapes.
"""

from __future__ import annotations

import copy
import io
import shutil

import pytest
from test_report import _chromium, _console_errors, _render, sample_report

from harness.report.matrix import build_matrix, print_matrix, render_matrix_html

pytestmark = pytest.mark.unit
PROMPTS = ["The capital of France is", "Once upon a time"]


def sample_matrix() -> dict:
    ours = sample_report()
    for c in ours["cases"]:  # ours passes everything that ran
        if c["status"] == "BLOCK":
            c["status"], c["verdict"] = "PASS", dict(c["verdict"], status="PASS", reasons=[], details=[])
    ours["verdict"] = "PASS"
    theirs = copy.deepcopy(sample_report())
    theirs["target"] = "npcache"
    case = next(c for c in theirs["cases"] if c["name"] == "single_element")
    case["verdict"]["first_difference"] = {"prompt": 0, "position": 0, "reference": 260, "candidate": 7042}
    case["verdict"]["reasons"] = ["output_mismatch"]
    case["reference"]["texts"] = [" the the the <garbage>"]
    case["cached"]["texts"] = [" Paris."]
    return build_matrix([ours, theirs], prompts=PROMPTS, timings={"verified_cache": 61.0, "npcache": 42.0},
                        model="tiny")


def test_matrix_has_a_verdict_per_target_per_case_and_the_answers():
    m = sample_matrix()
    assert m["targets"] == ["verified_cache", "npcache"]
    assert m["cells"]["single_element"]["verified_cache"]["status"] == "PASS"
    assert m["cells"]["single_element"]["npcache"]["status"] == "BLOCK"
    (a,) = m["answers"]
    assert (a["target"], a["case"], a["prompt"], a["cached"]) == ("npcache", "single_element", PROMPTS[0], " Paris.")
    out = io.StringIO()
    print_matrix(m, stream=out)
    text = out.getvalue()
    assert "' Paris.'" in text and "<garbage>" in text and "output_mismatch" in text
    # Control: with no differing tokens there is no answers section.
    m2 = build_matrix([sample_report()], prompts=PROMPTS)
    assert m2["answers"] == []


def test_matrix_html_shows_the_matrix_escaped_and_self_contained():
    html = render_matrix_html(sample_matrix())
    assert html.count('class="verdict BLOCK"') >= 2 and "npcache/report.html" in html
    assert "&lt;garbage&gt;" in html and "<garbage>" not in html
    assert "<script" not in html and "https://" not in html


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_matrix_page_renders_in_headless_chromium(tmp_path):
    browser = _chromium()
    assert browser
    page = tmp_path / "report.html"
    page.write_text(render_matrix_html(sample_matrix()))
    shot = tmp_path / "matrix.png"
    log = _render(browser, page, shot)
    assert _console_errors(log) == [], log[-2000:]
    shutil.copy(shot, tmp_path / "kept.png")
    # Control: the same check sees a broken page.
    bad = tmp_path / "bad.html"
    bad.write_text(page.read_text().replace("</body>", '<script>console.error("boom")</script></body>'))
    assert _console_errors(_render(browser, bad, tmp_path / "bad.png")), "console check saw nothing"


def test_demo_writes_the_matrix_page_and_each_targets_report(tmp_path, capsys):
    # ipc_cache alone runs no engine here (no CUDA): the demo's plumbing end to end in seconds.
    from harness.demo import run_demo
    from harness.targets.ipc_cache import missing_requirements

    if not missing_requirements():
        pytest.skip("this machine would run vLLM's ipc_cache for real")
    rc = run_demo(model="tiny", report_dir=str(tmp_path / "r"), workdir=str(tmp_path / "w"),
                  targets=("ipc_cache",))
    assert rc == 2  # our cache was not among the targets: the demo could not judge it
    page = (tmp_path / "r" / "report.html").read_text()
    assert "ipc_cache/report.html" in page and page.count('class="verdict NOT_RUN"') >= 4
    assert (tmp_path / "r" / "ipc_cache" / "report.json").is_file()
    assert "NOT_RUN" in capsys.readouterr().out
