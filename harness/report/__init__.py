"""Gate reports: one run, four readers.

``report.json`` for machines (validated against
``harness/schemas/report.schema.json``), ``report.md`` for a terminal or a
pull request, ``report.xml`` (JUnit, one testcase per case) for CI, and
``report.html`` (the verdict matrix, the fingerprint matrix and the phase
timings as inline SVG charts; no network) for people. Every file is written
atomically.

>>> write_reports(report.to_json(), "preload-gate-report")  # doctest: +SKIP
{'json': PosixPath('preload-gate-report/report.json'), ...}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.report.html import render_html
from harness.report.junit import render_junit
from harness.report.markdown import render_markdown
from pgbase import atomic


def write_reports(report: dict[str, Any], directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write report.{json,md,xml,html} into ``directory``; returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "report.json",
        "md": out / "report.md",
        "xml": out / "report.xml",
        "html": out / "report.html",
    }
    atomic.write_json(paths["json"], report)
    atomic.write_text(paths["md"], render_markdown(report))
    atomic.write_text(paths["xml"], render_junit(report))
    atomic.write_text(paths["html"], render_html(report))
    return paths


__all__ = ["render_html", "render_junit", "render_markdown", "write_reports"]
