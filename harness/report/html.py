"""report.html: the verdict matrix, the fingerprint matrix and phase timings.

Self-contained (inline CSS and SVG, no script, no network), so it opens from
a CI artifact store or an air-gapped laptop. Geometry for the charts is
computed here; the Jinja template only places it.
"""

from __future__ import annotations

from typing import Any

import jinja2

from harness.report.rows import summary_rows
from pgbase.schemes import SCHEMES

# Restart phases, in order, as offsets from process start (seconds).
PHASES = (("imported", "import vLLM"), ("ready", "load + warm up"), ("first_token", "first token"))
BAR_HEIGHT, BAR_GAP, LABEL_W, CHART_W = 16, 6, 230, 520

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("harness.report", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True, default=True),
    undefined=jinja2.StrictUndefined,
)


def timing_bars(report: dict[str, Any]) -> dict[str, Any]:
    """One bar per engine run (reference and cached of each case), split by phase."""
    runs: list[tuple[str, dict[str, float]]] = []
    for c in report["cases"]:
        for kind in ("reference", "cached"):
            r = c.get(kind) or {}
            t = r.get("timings") or {}
            if r.get("ok") and all(p in t for p, _ in PHASES):
                reused = " (cached ref)" if kind == "reference" and c.get("reference_reused") else ""
                runs.append((f"{c['name']} {kind}{reused}", t))
    longest = max((t["first_token"] for _, t in runs), default=1.0) or 1.0
    scale = CHART_W / longest
    bars = []
    for i, (label, t) in enumerate(runs):
        y = i * (BAR_HEIGHT + BAR_GAP)
        segs, prev = [], 0.0
        for k, (phase, name) in enumerate(PHASES):
            end = float(t[phase])
            segs.append({"x": LABEL_W + prev * scale, "w": max(0.5, (end - prev) * scale),
                         "cls": f"ph{k}", "title": f"{name}: {end - prev:.2f} s"})
            prev = end
        total = f"{prev:.1f} s"
        if "weights_load" in t:
            total += f" (weights {float(t['weights_load']):.2f} s)"
        bars.append({"y": y, "label": label, "segs": segs, "total": total,
                     "tx": LABEL_W + prev * scale + 4})
    height = max(1, len(bars)) * (BAR_HEIGHT + BAR_GAP) + 24
    ticks = []
    step = 5 if longest <= 40 else 10 if longest <= 100 else 30
    v = 0.0
    while v <= longest + 1e-9:
        ticks.append({"x": LABEL_W + v * scale, "label": f"{v:.0f}"})
        v += step
    return {"bars": bars, "height": height, "width": LABEL_W + CHART_W + 170, "ticks": ticks,
            "axis_y": height - 20, "phases": [n for _, n in PHASES], "bar_h": BAR_HEIGHT}


def fingerprint_matrix(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in report["cases"]:
        fp = c.get("fingerprints") or {}
        if not fp:
            continue
        cells = []
        for s in SCHEMES:
            eq = (fp.get(s) or {}).get("equal")
            # Red: a scheme calls different weights "the same" (the dangerous miss).
            danger = eq is True and not c["weights_equal"]
            cells.append({"text": "?" if eq is None else ("same" if eq else "differs"),
                          "cls": "unknown" if eq is None else ("danger" if danger else ("same" if eq else "diff"))})
        rows.append({"name": c["name"], "weights_equal": c["weights_equal"], "cells": cells})
    return rows


def render_template(name: str, **context: Any) -> str:
    """Render one of ``harness/report/templates`` with this module's environment
    (autoescaped, undefined names an error): the one place report HTML is made."""
    return _env.get_template(name).render(**context)


def render_html(report: dict[str, Any]) -> str:
    return _env.get_template("report.html.j2").render(
        report=report,
        rows=summary_rows(report),
        schemes=SCHEMES,
        fingerprints=fingerprint_matrix(report),
        chart=timing_bars(report),
    )
