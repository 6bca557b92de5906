"""The gate report a rollout believes: one row per forgery, refused by name,
beside the untouched report, which passes (its control).

The report is built in the gate's own shape (``GateReport.to_json``): a
promotion case (a hit on the candidate, tokens equal to ``auto``'s) and a
switch case (a daemon holding the base misses loudly), and the golden the
gate recorded, named by its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rollout_support import BASE, OTHER, SETTINGS, D, write_gate

from harness.rollout.evidence import ReportRefusedError, verify_gate_report
from preload.deployment import DeploymentSettings

pytestmark = pytest.mark.unit

def _edit_report(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(out: Path) -> None:
        r = json.loads((out / "report.json").read_text())
        fn(r)
        (out / "report.json").write_text(json.dumps(r))
    return apply


def _edit_golden(fn: Callable[[dict[str, Any]], None], reseal: bool = True) -> Callable[[Path], None]:
    """Edit the golden; ``reseal``: the forger also puts the new SHA-256 into the report."""
    def apply(out: Path) -> None:
        g = json.loads((out / "golden.json").read_text())
        fn(g)
        (out / "golden.json").write_text(json.dumps(g))
        if reseal:
            r = json.loads((out / "report.json").read_text())
            r["golden"]["sha256"] = hashlib.sha256((out / "golden.json").read_bytes()).hexdigest()
            (out / "report.json").write_text(json.dumps(r))
    return apply


def _promotion(r: dict[str, Any]) -> dict[str, Any]:
    return r["cases"][0]


def _flip_blocked_case(r: dict[str, Any]) -> None:
    """A case the gate BLOCKED (a hit on other content) with its status edited to PASS."""
    _promotion(r)["cached"]["events"][0].update(digest=OTHER, daemon_digest=OTHER)


def _digest_fields_edited(r: dict[str, Any]) -> None:
    """A report of another checkpoint whose digest fields were all edited to D (the evidence was not)."""
    for c in r["cases"]:
        for e in c["cached"]["events"]:
            e["digest"] = OTHER
            if "daemon_digest" in e:
                e["daemon_digest"] = OTHER


def _tokens_edited(r: dict[str, Any]) -> None:
    _promotion(r)["cached"]["token_ids"][1][0] += 1


def _tolerance(r: dict[str, Any]) -> None:
    r["logprob_tolerance"] = 10.0
    _promotion(r)["cached"]["logprobs"][0][0] = {str(_promotion(r)["cached"]["token_ids"][0][0]): -5.0}


FORGERIES: list[tuple[str, Callable[[Path], None], str]] = [
    ("blocked case edited to PASS", _edit_report(_flip_blocked_case), "its own evidence judges BLOCK (wrong_hit"),
    ("report of another checkpoint", _edit_report(lambda r: [c.update(candidate_digest=OTHER) for c in r["cases"]]),
     "a report of another checkpoint"),
    ("digest fields edited, events not", _edit_report(_digest_fields_edited), "judges BLOCK"),
    ("cached tokens differ from auto", _edit_report(_tokens_edited), "output_mismatch"),
    ("loosened tolerance hides drift", _edit_report(_tolerance), "looser than the gate's"),
    ("other settings", _edit_report(lambda r: [c["settings"].update(dtype="float16") for c in r["cases"]]),
     "ran under other settings: dtype=float16 (deployment: bfloat16)"),
    ("negative control on", _edit_report(lambda r: r["controls"].update(unsafe_identity="header_only")),
     "negative controls on (unsafe_identity)"),
    ("self-test report", _edit_report(lambda r: r.update(mode="self-test")), "it is a self-test report"),
    ("another cache judged", _edit_report(lambda r: r.update(target="header_only")), "judged the header_only cache"),
    ("gate blocked", _edit_report(lambda r: r.update(verdict="BLOCK", exit_code=1)), "the gate did not pass"),
    ("a case blocked", _edit_report(lambda r: _promotion(r).update(status="BLOCK")), "is BLOCK, not PASS"),
    ("another vLLM", _edit_report(lambda r: r.update(vllm_version="0.1.0")), "this host serves"),
    ("no promotion case", _edit_report(lambda r: r["cases"].pop(0)), "no promotion case"),
    ("golden swapped, seal not", _edit_golden(lambda g: g["prompts"][0]["token_ids"].__setitem__(3, 7), reseal=False),
     "the golden it recorded (SHA-256"),
    ("golden of another digest", _edit_golden(lambda g: g.update(digest=OTHER)), "keyed by digest eeeeeeee"),
    ("golden under other settings", _edit_golden(lambda g: g["settings"].update(dtype="float16")),
     "recorded under other settings: dtype=float16"),
    ("golden that is not the reference's answers", _edit_golden(lambda g: g["prompts"][2]["token_ids"].__setitem__(1, 7)),
     "does not answer as the gate's auto reference did (prompt 2, position 1)"),
    ("report older than golden seals", _edit_report(lambda r: r["golden"].pop("sha256")), "older gate"),
    ("no golden recorded, none named", _edit_report(lambda r: r.update(golden={"recorded": False, "note": "--no-golden"})),
     "records no golden (--no-golden); name the golden recorded beside it with --golden"),
    ("not a report", lambda out: (out / "report.json").write_text("[]"), "not a preload-gate report"),
]


def test_untouched_report_passes(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    ev = verify_gate_report(out, D, SETTINGS)
    assert ev.golden == out / "golden.json" and ev.cases == ("promotion", "switch_from_base") and not ev.notes


@pytest.mark.parametrize(("name", "forge", "why"), FORGERIES, ids=[f[0] for f in FORGERIES])
def test_forgery_is_refused_by_name(tmp_path: Path, name: str, forge: Callable[[Path], None], why: str) -> None:
    out = write_gate(tmp_path)
    verify_gate_report(out, D, SETTINGS)  # the neighbour: the same report before the edit passes
    forge(out)
    with pytest.raises(ReportRefusedError) as e:
        verify_gate_report(out, D, SETTINGS)
    assert why in str(e.value) and str(out / "report.json") in str(e.value), (name, str(e.value))


def test_a_report_is_checked_against_our_digest_not_its_own(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    with pytest.raises(ReportRefusedError, match="a report of another checkpoint"):
        verify_gate_report(out, OTHER, SETTINGS)


def test_deployment_settings_decide_not_the_reports(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    with pytest.raises(ReportRefusedError, match="max_model_len=256 \\(deployment: 512\\)"):
        verify_gate_report(out, D, DeploymentSettings(dtype="bfloat16", max_model_len=512))


def test_a_golden_the_operator_names_must_be_the_reports(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    other = tmp_path / "mine.json"
    g = json.loads((out / "golden.json").read_text())
    g["recorded_at"] = "another recording"
    other.write_text(json.dumps(g))
    with pytest.raises(ReportRefusedError, match="is not the one this gate recorded"):
        verify_gate_report(out, D, SETTINGS, golden=other)
    assert verify_gate_report(out, D, SETTINGS, golden=out / "golden.json").golden == out / "golden.json"


def test_a_moved_report_finds_its_golden_beside_it(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    moved = tmp_path / "moved"
    out.rename(moved)
    assert verify_gate_report(moved, D, SETTINGS).golden == moved / "golden.json"


def _unsealed(out: Path) -> Path:
    """The pipeline's shape: ``gate --no-golden``, the golden recorded apart (OUT/golden.json)."""
    r = json.loads((out / "report.json").read_text())
    r["golden"] = {"recorded": False, "note": "--no-golden: the canary golden was not recorded"}
    (out / "report.json").write_text(json.dumps(r))
    apart = out.parent / "golden.json"
    (out / "golden.json").rename(apart)
    return apart


def test_a_golden_recorded_apart_is_bound_by_its_answers(tmp_path: Path) -> None:
    out = write_gate(tmp_path)
    apart = _unsealed(out)
    ev = verify_gate_report(out, D, SETTINGS, golden=apart)
    assert ev.golden == apart and any("bound by its digest, settings and answers" in n for n in ev.notes)


def test_a_golden_recorded_apart_with_other_answers_is_refused(tmp_path: Path) -> None:
    """The control of the test above: the same unsealed golden, its answers edited."""
    out = write_gate(tmp_path)
    apart = _unsealed(out)
    g = json.loads(apart.read_text())
    g["prompts"][0]["token_ids"][0] += 1
    apart.write_text(json.dumps(g))
    with pytest.raises(ReportRefusedError, match="does not answer as the gate's auto reference did \\(prompt 0, position 0\\)"):
        verify_gate_report(out, D, SETTINGS, golden=apart)


def test_the_gate_seals_the_golden_it_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """harness.gate.golden names the SHA-256 of the file it wrote (what the seal checks)."""
    import canaries.golden as golden_mod
    from harness.gate.golden import record_golden
    from harness.gate.options import GateOptions

    monkeypatch.setattr(golden_mod, "record", lambda ckpt, out, settings=None: Path(out).write_text("{}"))
    got = record_golden(GateOptions(candidate="/m", report_dir=str(tmp_path)), Path("/m"))
    assert got["recorded"] and got["sha256"] == hashlib.sha256(b"{}").hexdigest()


# ---------------------------------------------------------------- the gate run here (no --gate-report)

class _GateRun:
    """What run_gate returns, for a flow test: a report document and its exit code."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc, self.exit_code, self.error = doc, doc["exit_code"], None

    def to_json(self) -> dict[str, Any]:
        return self.doc


def _flow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocked: bool):
    import harness.gate as gate
    from harness.rollout.flow import Flow
    from preload_gate.cli import build_parser

    for name in ("A", "B"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))

    def fake_gate(opts: Any) -> _GateRun:
        out = write_gate(tmp_path / "run", digest=D)
        doc = json.loads((out / "report.json").read_text())
        (Path(opts.report_dir)).mkdir(parents=True, exist_ok=True)
        g = json.loads((out / "golden.json").read_text())
        # Recorded from B as it is (no config.json, no answer files): the rollout checks it fits B.
        g.update(config_digest=None, answer_files={})
        (Path(opts.report_dir) / "golden.json").write_text(json.dumps(g))
        doc["golden"]["sha256"] = hashlib.sha256((Path(opts.report_dir) / "golden.json").read_bytes()).hexdigest()
        doc["golden"]["path"] = str(Path(opts.report_dir) / "golden.json")
        if blocked:
            doc.update(verdict="BLOCK", exit_code=1)
        return _GateRun(doc)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(gate, "run_gate", fake_gate)
    args = build_parser().parse_args(["rollout", "--from", str(tmp_path / "A"), "--to", str(tmp_path / "B"),
                                      "--replicas", "1", "--port", "9000", "--state-dir", str(tmp_path / "state"),
                                      "--", "--dtype", "bfloat16", "--max-model-len", "256"])
    flow = Flow(args, ["--dtype", "bfloat16", "--max-model-len", "256"], None)
    monkeypatch.setattr(flow, "_digest", lambda path, label, root: BASE if path.endswith("/A") else D)
    return flow


def test_without_a_report_the_gate_runs_here_and_its_report_is_bound(tmp_path: Path, monkeypatch) -> None:
    flow = _flow(tmp_path, monkeypatch, blocked=False)
    flow._prepare_dirs()
    seq = flow.sequence(flow.plan(), str(tmp_path / "sock"))
    from harness.rollout.identity import identity

    key = identity(D, tmp_path / "B")  # the gate's report dir is named by B's identity
    assert seq[1].golden == str(tmp_path / "state" / f"gate-{key[:16]}" / "golden.json")
    assert flow.evidence and flow.evidence[0]["digest"] == D


def test_a_gate_that_blocks_here_ends_the_rollout_with_exit_1(tmp_path: Path, monkeypatch) -> None:
    from harness.rollout.flow import GateBlockedError

    flow = _flow(tmp_path, monkeypatch, blocked=True)
    flow._prepare_dirs()
    with pytest.raises(GateBlockedError, match="the gate BLOCKED B"):
        flow.sequence(flow.plan(), str(tmp_path / "sock"))


def _config_only_report(tmp_path: Path) -> Path:
    """The gate of B --base A where B is A's weights with another config.json: the
    switch case's daemon holds the same digest; its engine missed on config_digest."""
    out = write_gate(tmp_path)
    doc = json.loads((out / "report.json").read_text())
    switch = next(c for c in doc["cases"] if c["name"] == "switch_from_base")
    switch["daemon_digest"] = D
    for e in switch["cached"]["events"]:
        e.update(reason="key mismatch on fields: config_digest", fields=["config_digest"], daemon_digest=D)
    (out / "report.json").write_text(json.dumps(doc))
    return out


def test_a_config_only_gate_report_is_judged_with_the_config_the_rollout_saw(tmp_path: Path) -> None:
    """Issue 37: the re-judgement observes config.json as the gate does: a miss
    on the base's daemon is right when the configs differ. Control: judged on
    the weights digest alone, the same report is refused (a hit 'required')."""
    out = _config_only_report(tmp_path)
    assert verify_gate_report(out, D, SETTINGS, base_config_differs=True).digest == D
    with pytest.raises(ReportRefusedError, match="unexpected_miss"):
        verify_gate_report(out, D, SETTINGS)
