"""``preload-gate demo``: the whole self-test on an embedded model, end to end.

Builds the fixture (the tiny checkpoint by default: the full self-test runs
in minutes on two cores; ``--model smollm2`` converts SmolLM2-135M, slower
and more convincing), then runs the gate's self-test on it: promote, start
the daemon on the base, every mutation case against ``auto``, the report
in ``./preload-gate-report``. Exits with the gate's code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from harness.gate import GateOptions, run_gate
from harness.report import write_reports
from harness.report.terminal import TerminalProgress, print_summary

MODELS = ("tiny", "smollm2")


def build_model(model: str, out: Path) -> Path:
    if model == "tiny":
        from fixtures.tiny import write_tiny

        return write_tiny(out)
    from fixtures.smollm2 import write_smollm2

    return write_smollm2(out)


def run_demo(model: str = "tiny", report_dir: str = "preload-gate-report", mutations: str = "all",
             jobs: int = 1, workdir: str | None = None, reference_cache: str | None = None,
             run_tp: bool = False, engine_timeout_s: float = 300.0) -> int:
    progress = TerminalProgress()
    scratch = Path(workdir or tempfile.mkdtemp(prefix="preload-gate-demo-"))
    try:
        progress("fixture", f"building the {model} checkpoint in {scratch / model}")
        ckpt = build_model(model, scratch / model)
        report = run_gate(GateOptions(
            candidate=str(ckpt), mutations=mutations, report_dir=report_dir, jobs=jobs,
            workdir=str(scratch / "gate"), reference_cache=reference_cache, progress=progress,
            run_tp=run_tp, engine_timeout_s=engine_timeout_s,
        ))
        doc = report.to_json()
        paths = write_reports(doc, report_dir)
        print_summary(doc)
        print(f"report: {paths['html']} (also report.json, report.md, report.xml)")
        return report.exit_code
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
