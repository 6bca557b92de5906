"""The cross-target matrix: one verdict per target per case, from gate reports.

``preload-gate demo`` runs the gate once per target on the same cases and
puts the reports side by side: a terminal table, ``matrix.json`` and the
HTML page (``report.html`` of the demo). Where a cached engine's greedy
tokens differ from ``auto``'s, the matrix keeps what each answered for the
first differing prompt: the symptom a wrong hit shows (the mutant's
``auto`` answers garbage, the stale cache answers like the base).
"""

from __future__ import annotations

import sys
from typing import Any

import jinja2

from harness.report.rows import outcome

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("harness.report", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True, default=True),
    undefined=jinja2.StrictUndefined,
)
_STYLE = {"PASS": "bold green", "BLOCK": "bold red", "NOT_RUN": "yellow"}


def _answers(case: dict[str, Any]) -> dict[str, Any] | None:
    first = (case.get("verdict") or {}).get("first_difference")
    if not first:
        return None
    p = first["prompt"]
    ref = (case.get("reference") or {}).get("texts") or []
    got = (case.get("cached") or {}).get("texts") or []
    if p >= min(len(ref), len(got)):
        return None
    return {"prompt_index": p, "auto": ref[p], "cached": got[p]}


def build_matrix(reports: list[dict[str, Any]], prompts: list[str] | None = None,
                 timings: dict[str, float] | None = None, model: str = "") -> dict[str, Any]:
    """``{"targets", "cases", "cells": {case: {target: cell}}, "answers": [...]}``."""
    targets = [r["target"] for r in reports]
    cases: list[str] = []
    descriptions: dict[str, str] = {}
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    answers = []
    for r in reports:
        for c in r["cases"]:
            if c["name"] not in cells:
                cases.append(c["name"])
                descriptions[c["name"]] = c["description"]
                cells[c["name"]] = {}
            v = c.get("verdict") or {}
            cell = {"status": c["status"], "reasons": list(v.get("reasons") or []), "load": outcome(c),
                    "detail": "; ".join(v.get("details") or []) or c.get("not_run_reason", ""),
                    "seconds": (c.get("cached") or {}).get("timings", {}).get("wall")}
            cells[c["name"]][r["target"]] = cell
            a = _answers(c)
            if a is not None:
                a.update(case=c["name"], target=r["target"], reasons=cell["reasons"],
                         prompt=(prompts[a["prompt_index"]] if prompts and a["prompt_index"] < len(prompts) else ""))
                answers.append(a)
    return {"model": model, "targets": targets, "cases": cases, "descriptions": descriptions,
            "cells": cells, "answers": answers, "timings": timings or {},
            "verdicts": {r["target"]: r["verdict"] for r in reports},
            "reports": {r["target"]: f"{r['target']}/report.html" for r in reports}}


def render_matrix_html(matrix: dict[str, Any]) -> str:
    return _env.get_template("matrix.html.j2").render(m=matrix)


def print_matrix(matrix: dict[str, Any], stream: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream or sys.stdout, highlight=False, width=160)
    table = Table(title=f"preload-gate demo: verdict per target per case ({matrix['model']})")
    table.add_column("case")
    for t in matrix["targets"]:
        table.add_column(t)
    for name in matrix["cases"]:
        row = [name]
        for t in matrix["targets"]:
            cell = matrix["cells"][name].get(t)
            if cell is None:
                row.append("")
                continue
            text = f"[{_STYLE[cell['status']]}]{cell['status']}[/]"
            if cell["reasons"]:
                text += "\n" + ", ".join(cell["reasons"])
            if cell["load"] not in ("-", "none"):
                text += f"\n(load: {cell['load']})"
            row.append(text)
        table.add_row(*row)
    console.print(table)
    for a in matrix["answers"]:
        console.print(f"{a['target']} on {a['case']}: prompt {a['prompt']!r}", markup=False)
        console.print(f"    auto on the candidate answered: {a['auto']!r}", markup=False)
        console.print(f"    the cached engine answered:     {a['cached']!r}", markup=False)
    for t, s in matrix["timings"].items():
        console.print(f"{t}: {s:.0f} s", markup=False)
