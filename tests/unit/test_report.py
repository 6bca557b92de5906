"""Reports from gate results: JSON Schema, JUnit XSD, Markdown, HTML.

``data/gate_report_selftest_full.json`` is the report.json of a real full
self-test (``preload-gate demo``, tiny fixture, vLLM CPU 0.32.0), its
logprobs trimmed to two positions per prompt to keep the file small.

Each validator has a control: a report broken in one place must fail it,
so a validator that accepts anything cannot pass these tests.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import xmlschema

from harness.engine import EngineResult
from harness.gate import CaseResult, GateReport
from harness.report import render_html, render_junit, render_markdown, write_reports
from harness.verdict import BLOCK, NOT_RUN, PASS, Verdict

pytestmark = pytest.mark.unit

SCHEMAS = Path(__file__).resolve().parents[2] / "harness" / "schemas"
D1, D2 = "1" * 64, "2" * 64
TIMINGS = {"imported": 6.1, "ready": 24.0, "first_token": 24.1, "done": 25.0, "wall": 27.0, "weights_load": 0.02}


def _engine(tokens, events=()):
    return EngineResult(ok=True, token_ids=tokens, texts=["x"] * len(tokens),
                        logprobs=[[{str(t): -0.1} for t in row] for row in tokens], events=list(events),
                        timings=dict(TIMINGS), returncode=0, vllm_version="0.32.0")


def sample_report() -> dict:
    hit = {"outcome": "hit", "reason": "daemon served the key", "fields": [], "digest": D1, "daemon_digest": D1,
           "mode": "zero_copy", "seconds": 0.01, "tensors": 20, "bytes": 1300000, "rank": 0}
    miss = dict(hit, outcome="miss", reason="no daemon for this digest", fields=["content_digest"], digest=D2,
                daemon_digest=None)
    fp = {"header_only": {"equal": True}, "sampled_1k": {"equal": True}, "path_stat": {"equal": False},
          "realpath": {"equal": False}, "content": {"equal": False}}
    cases = [
        CaseResult("identical_copy", "copy <elsewhere> & \"quoted\"", "hit", True,
                   {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1}, PASS,
                   candidate="/c", candidate_digest=D1, daemon_digest=D1, verdict=Verdict(PASS, outcome="hit"),
                   reference=_engine([[1, 2, 3]]), cached=_engine([[1, 2, 3]], [hit]), reference_reused=True,
                   fingerprints=dict(fp, content={"equal": True})),
        CaseResult("tail_edit", "tail", "miss", False,
                   {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1}, PASS,
                   candidate="/t", candidate_digest=D2, daemon_digest=D1, verdict=Verdict(PASS, outcome="miss"),
                   reference=_engine([[1, 2, 4]]), cached=_engine([[1, 2, 4]], [miss]), fingerprints=fp),
        CaseResult("single_element", "one element", "miss", False,
                   {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1}, BLOCK,
                   candidate="/s", candidate_digest=D2, daemon_digest=D1,
                   verdict=Verdict(BLOCK, ["wrong_hit"], ["wrong_hit: hit on <script>alert(1)</script>"], "hit"),
                   reference=_engine([[1, 2, 3]]), cached=_engine([[1, 2, 3]], [hit]), fingerprints=fp),
        CaseResult("dp_shift", "dp", "miss", True,
                   {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 2}, NOT_RUN,
                   not_run_reason="vLLM's CPU build has no data-parallel engine",
                   key_check={"ok": True, "expected_fields": ["dp_size"], "mismatched_fields": ["dp_size"],
                              "note": ""}),
    ]
    r = GateReport("self-test", "verified_cache", "/tiny", "/tiny", cases,
                   {"unsafe_identity": None, "unsafe_silent_fallback": False, "run_tp": False}, 1e-3, "0.32.0",
                   seconds=123.4)
    return json.loads(json.dumps(r.to_json()))


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((SCHEMAS / "report.schema.json").read_text())


RECORDED = sorted((Path(__file__).parent / "data").glob("gate_report_*.json"))


@pytest.mark.parametrize("doc", [sample_report()] + [json.loads(p.read_text()) for p in RECORDED],
                         ids=["sample"] + [p.stem for p in RECORDED])
def test_report_json_validates(schema, doc):
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    xmlschema.XMLSchema(SCHEMAS / "junit.xsd").validate(render_junit(doc))


@pytest.mark.parametrize("breakage", [
    lambda d: d.update(verdict="PASSED"),
    lambda d: d["cases"][2]["verdict"].update(reasons=[]),  # a BLOCK must say why
    lambda d: d["cases"][0]["verdict"].update(reasons=["wrong_hit"]),  # a PASS must not carry reasons
    lambda d: d["cases"][3].update(not_run_reason=""),  # not run must say why
    lambda d: d["cases"][1]["verdict"].update(reasons=["flaky"]),
    lambda d: d["cases"][0].update(candidate_digest="xyz"),
    lambda d: d.pop("cases"),
])
def test_schema_rejects_broken_reports(schema, breakage):
    doc = sample_report()
    breakage(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


def test_junit_maps_statuses_and_xsd_rejects_broken_xml():
    doc = sample_report()
    xml = render_junit(doc)
    xsd = xmlschema.XMLSchema(SCHEMAS / "junit.xsd")
    xsd.validate(xml)
    tree = xsd.to_dict(xml)
    suite = tree["testsuite"][0]
    assert (suite["@tests"], suite["@failures"], suite["@errors"], suite["@skipped"]) == (4, 1, 0, 1)
    # Controls: the XSD is not a rubber stamp.
    for bad in (xml.replace('name="tail_edit" ', ""), xml.replace('tests="4"', 'tests="four"'),
                xml.replace("<skipped ", "<skipped/><failure ")):
        assert not xsd.is_valid(bad)


def test_markdown_lists_every_case_and_never_calls_not_run_passed():
    md = render_markdown(sample_report())
    assert "BLOCK (exit 1)" in md.splitlines()[0]
    verdicts = md.split("## Fingerprint matrix")[0]
    rows = {ln.split("|")[1].strip(): ln for ln in verdicts.splitlines() if ln.startswith("| ") and "---" not in ln}
    assert "## Fingerprint matrix" in md and "| single_element | no | = | = | x | x | x |" in md
    assert "not run" in rows["dp_shift"] and "PASS" not in rows["dp_shift"]
    assert "**BLOCK**" in rows["single_element"] and "wrong_hit" in rows["single_element"]
    assert "| hit |" in rows["identical_copy"] and "| miss |" in rows["tail_edit"]
    assert "1 passed" not in md and "2 passed, 1 blocked, 1 not run" in md


def test_markdown_shows_what_each_engine_answered_where_tokens_differ():
    report = sample_report()
    assert "## Where tokens differ" not in render_markdown(report)  # control: no difference, no section
    case = next(c for c in report["cases"] if c["name"] == "single_element")
    case["verdict"]["first_difference"] = {"prompt": 0, "position": 0, "reference": 260, "candidate": 7042}
    case["reference"]["texts"] = [" the capital of the city of"]
    case["cached"]["texts"] = [" Paris.|"]
    section = render_markdown(report).split("## Where tokens differ")[1]
    row = next(ln for ln in section.splitlines() if ln.startswith("| single_element"))
    assert "the capital of the city of" in row and "Paris.\\|" in row


def test_markdown_says_which_node_ran_each_engine_on_a_ray_run():
    report = sample_report()
    assert "## Where each engine ran" not in render_markdown(report)  # control: a local run has no such section
    report["executor"] = {"kind": "ray", "address": "ray://head:10001", "nodes": [{"node": "a" * 56}, {"node": "b" * 56}]}
    case = next(c for c in report["cases"] if c["name"] == "single_element")
    case["placement"] = {"cached": {"node": "b" * 56, "attempts": [
                             {"node": "a" * 56, "why": "node aaaaaaaaaaaa: NodeDiedError: lost"}, {"node": "b" * 56}]},
                         "reference": {"node": None, "attempts": [], "reused": True}}
    section = render_markdown(report).split("## Where each engine ran")[1]
    assert "ray://head:10001, 2 node(s)" in section
    row = next(ln for ln in section.splitlines() if ln.startswith("| single_element"))
    assert row == "| single_element | bbbbbbbbbbbb | reused | node aaaaaaaaaaaa: NodeDiedError: lost |"


def test_html_is_self_contained_and_escaped():
    html = render_html(sample_report())
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html and "<script" not in html
    assert html.count("<rect ") == 3 * 6  # 3 phases x 6 engine runs (dp_shift ran none)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _render(browser: str, html: Path, shot: Path) -> str:
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--enable-logging=stderr", "--v=0", f"--user-data-dir={html.parent / 'profile'}",
         "--window-size=1280,1600", f"--screenshot={shot}", html.as_uri()],
        capture_output=True, text=True, timeout=90,
    )
    assert shot.exists() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
    return proc.stderr


def _console_errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "CONSOLE" in ln or "Uncaught" in ln or "ERR_FILE_NOT_FOUND" in ln]


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_html_renders_in_headless_chromium_without_console_errors(tmp_path):
    browser = _chromium()
    assert browser
    paths = write_reports(sample_report(), tmp_path / "report")
    shot = tmp_path / "report.png"
    log = _render(browser, paths["html"], shot)
    assert _console_errors(log) == [], log[-2000:]
    shutil.copy(shot, paths["html"].with_suffix(".png"))
    # Control: the same check sees a page that does log an error and load a missing file.
    bad = tmp_path / "bad.html"
    bad.write_text(paths["html"].read_text().replace(
        "</body>", '<script>console.error("boom")</script><img src="missing.png"></body>'))
    assert _console_errors(_render(browser, bad, tmp_path / "bad.png")), "console check saw nothing"


def test_write_reports_is_atomic_and_complete(tmp_path):
    doc = sample_report()
    paths = write_reports(doc, tmp_path)
    assert json.loads(paths["json"].read_text()) == doc
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    before = copy.deepcopy(doc)
    write_reports(doc, tmp_path)
    assert doc == before


@pytest.mark.skipif(not RECORDED, reason="no recorded report in tests/unit/data")
def test_recorded_self_test_shows_hits_and_loud_misses():
    doc = json.loads(RECORDED[0].read_text())
    md = render_markdown(doc)
    assert "11 passed, 0 blocked, 2 not run" in md
    outcomes = {c["name"]: (c["verdict"] or {}).get("outcome") for c in doc["cases"]}
    assert outcomes.pop("identical_copy") == "hit"
    assert outcomes.pop("tp_shift") is None and outcomes.pop("dp_shift") is None
    assert set(outcomes.values()) == {"miss"}
    # every miss is loud: one event naming its reason
    for c in doc["cases"]:
        if c["status"] == "PASS" and c["expect"] == "miss":
            (event,) = c["cached"]["events"]
            assert event["outcome"] == "miss" and event["reason"]


def test_schema_names_every_verdict_reason_and_holds_an_unusable_reference(schema):
    """The schema's reasons are the verdict's (a new reason cannot be left
    out of it), and a case judged NOT_RUN for an unusable reference is a
    valid report whose JUnit entry is skipped with the reason."""
    import math

    from harness.verdict import NOT_RUN_REASONS, REASONS, Expectation, judge

    enum = schema["$defs"]["verdict"]["properties"]["reasons"]["items"]["enum"]
    assert sorted(enum) == sorted(REASONS + NOT_RUN_REASONS)
    hit = {"outcome": "hit", "reason": "daemon served the key", "fields": [], "digest": D1, "daemon_digest": D1,
           "rank": 0}
    ref = _engine([[1, 2, 3]])
    ref.logprobs = [[{k: math.nan for k in step} for step in row] for row in ref.logprobs]
    case = CaseResult("nan_reference", "fp8 config on bf16", "hit", True,
                      {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1}, NOT_RUN,
                      candidate="/n", candidate_digest=D1, daemon_digest=D1,
                      reference=ref, cached=_engine([[1, 2, 3]], [hit]))
    case.record(judge(Expectation("hit", D1, D1), ref, case.cached))
    r = GateReport("promotion", "verified_cache", "/n", "/n", [case],
                   {"unsafe_identity": None, "unsafe_silent_fallback": False, "run_tp": False}, 1e-3, "0.32.0")
    # Strict JSON (jq and browsers refuse a bare NaN): the logprobs keep their word for it.
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert doc["cases"][0]["reference"]["logprobs"][0][0] == {"1": "NaN"}
    assert doc["verdict"] == NOT_RUN and doc["exit_code"] == 2
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert 'skipped message="not run: reference_unusable: the auto reference' in render_junit(doc)
    # Controls: an unusable reference never rides on a PASS, nor on a BLOCK.
    for status in (PASS, BLOCK):
        bad = copy.deepcopy(doc)
        bad["cases"][0]["status"] = bad["cases"][0]["verdict"]["status"] = status
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)
