"""The gate on a terminal: progress lines while it runs, a summary table after.

Uses rich, which degrades to plain lines when stdout is a CI log.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from harness.report.rows import summary_rows

_STYLE = {"PASS": "bold green", "BLOCK": "bold red", "NOT_RUN": "yellow"}


class TerminalProgress:
    """``progress(stage, message)`` callback for :class:`harness.gate.GateOptions`."""

    def __init__(self, stream: Any = None) -> None:
        from rich.console import Console

        self.console = Console(file=stream or sys.stderr, highlight=False)
        self.t0 = time.monotonic()

    def __call__(self, stage: str, message: str) -> None:
        elapsed = time.monotonic() - self.t0
        style = "dim" if stage in ("prepare", "engine-start") else ""
        if stage == "verdict":
            status = message.split(": ", 1)[1].split(" ", 1)[0] if ": " in message else ""
            style = _STYLE.get(status, "")
        self.console.print(f"[{elapsed:6.0f}s] {stage:<12} {message}", style=style, markup=False,
                           soft_wrap=True)  # one line per event, even in a CI log narrower than the path


def print_summary(report: dict[str, Any], stream: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream or sys.stdout, highlight=False)
    table = Table(title=f"preload-gate {report['mode']} ({report['target']})")
    for col in ("case", "expected", "load", "verdict", "reasons", "tokens vs auto"):
        table.add_column(col)
    for r in summary_rows(report):
        table.add_row(r["name"], r["expect"], r["outcome"], f"[{_STYLE[r['status']]}]{r['status']}[/]",
                      r["reasons"], r["tokens"])
    console.print(table)
    c = report["counts"]
    console.print(
        f"[{_STYLE[report['verdict']]}]{report['verdict']}[/]: {c['PASS']} passed, {c['BLOCK']} blocked, "
        f"{c['NOT_RUN']} not run, {report['seconds']:.0f} s (exit {report['exit_code']})"
    )
    # Why cases were not run, once each: the table has no room for it, and a not-run without its
    # reason reads like a pass that was skipped.
    for why in dict.fromkeys(c.get("not_run_reason") for c in report["cases"] if c["status"] == "NOT_RUN"):
        if why:
            console.print(f"not run: {why}", markup=False)
    if report.get("error"):
        console.print(f"error: {report['error']}", markup=False)
