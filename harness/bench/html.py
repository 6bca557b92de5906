"""bench.html: one bar chart per result, anchor beside ours with the ratio, and the table.

Self-contained (inline CSS and SVG, no script, no network) so it opens from
a CI artifact store or an air-gapped laptop, like report.html. Geometry is
computed here; the Jinja template only places it, with autoescape on: row
titles and labels come from checkpoints and parameters, never trusted markup.

>>> write_html(results, Path("out/bench.html"))  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from harness.bench import BenchResult, distinct_tables, ratio_text
from pgbase import atomic

LABEL_W, BAR_W, BAR_H, GAP, VALUE_W = 300, 360, 18, 8, 90

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("harness.bench", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True, default=True),
    undefined=jinja2.StrictUndefined,
)


@dataclass(frozen=True)
class Bar:
    label: str
    value_text: str
    y: int
    width: float
    css: str


@dataclass(frozen=True)
class Chart:
    """One result drawn: its two bars and the ratio line under them."""

    title: str
    row: str
    bars: tuple[Bar, ...]
    ratio: str
    target: str
    notes: str
    not_run: str | None
    width: int = LABEL_W + BAR_W + VALUE_W
    height: int = 2 * (BAR_H + GAP) + GAP


def chart(r: BenchResult) -> Chart:
    """Bars share one scale per result: the longer figure spans the chart."""
    longest = max(abs(r.anchor.value), abs(r.ours.value)) or 1.0
    bars = tuple(
        Bar(label=fig.label, value_text=fig.text(), y=GAP + i * (BAR_H + GAP),
            width=round(max(1.0, BAR_W * abs(fig.value) / longest), 1), css=css)
        for i, (fig, css) in enumerate(((r.anchor, "anchor"), (r.ours, "ours")))
    )
    return Chart(title=r.title, row=r.row, bars=bars, ratio=ratio_text(r), target=r.target,
                 notes=r.notes, not_run=r.not_run)


def raw_tables(results: list[BenchResult]) -> list[dict[str, Any]]:
    """Each distinct ``details["table"]`` once, as markdown prints them."""
    tables = []
    for row, table in distinct_tables(results):
        cols = list(table[0])
        tables.append({"row": row, "cols": cols, "rows": [[str(t.get(c, "")) for c in cols] for t in table]})
    return tables


def render(results: list[BenchResult]) -> str:
    return _env.get_template("bench.html.j2").render(
        charts=[chart(r) for r in results],
        results=results,
        ratio_text=ratio_text,
        tables=raw_tables(results),
        label_w=LABEL_W,
        bar_h=BAR_H,
        value_w=VALUE_W,
    )


def write_html(results: list[BenchResult], path: Path) -> Path:
    atomic.write_text(path, render(results))
    return path
