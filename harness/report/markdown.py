"""report.md: the summary table a person reads in a terminal or a PR."""

from __future__ import annotations

from typing import Any

from harness.report.rows import summary_rows
from pgbase.schemes import SCHEMES

_MARK = {"PASS": "PASS", "BLOCK": "**BLOCK**", "NOT_RUN": "not run"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [
        f"# preload-gate {report['mode']}: {report['verdict']} (exit {report['exit_code']})",
        "",
        f"- target: `{report['target']}`; candidate: `{report['candidate']}`; base: `{report['base']}`",
        f"- vLLM {report.get('vllm_version') or 'unknown'}; logprob tolerance {report['logprob_tolerance']:g} nats;"
        f" {report['seconds']:.0f} s",
        f"- cases: {c['PASS']} passed, {c['BLOCK']} blocked, {c['NOT_RUN']} not run"
        " (not run is never counted as passed)",
    ]
    controls = {k: v for k, v in report["controls"].items() if v}
    if controls:
        lines.append(f"- controls (unsafe on purpose): {controls}")
    if report.get("error"):
        lines.append(f"- error: {report['error']}")
    golden = report.get("golden") or {}
    if golden:
        lines.append(f"- golden canary file: {golden.get('path') or golden.get('note')}")
    lines += [
        "",
        "| case | expected | load | verdict | reasons | tokens vs auto | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary_rows(report):
        lines.append(
            f"| {r['name']} | {r['expect']} | {r['outcome']} | {_MARK[r['status']]} | "
            f"{r['reasons']} | {r['tokens']} | {_cell(r['detail'])} |"
        )
    fp_cases = [x for x in report["cases"] if x.get("fingerprints")]
    if fp_cases:
        lines += ["", "## Fingerprint matrix (base vs candidate: = same key, x different key)", "",
                  "| case | weights equal | " + " | ".join(SCHEMES) + " |",
                  "|---|---|" + "---|" * len(SCHEMES)]
        for x in fp_cases:
            cells = []
            for s in SCHEMES:
                e = x["fingerprints"].get(s, {}).get("equal")
                cells.append("?" if e is None else ("=" if e else "x"))
            lines.append(f"| {x['name']} | {'yes' if x['weights_equal'] else 'no'} | " + " | ".join(cells) + " |")
    lines += _placement(report)
    lines += _differing_outputs(report)
    return "\n".join(lines) + "\n"


def _placement(report: dict[str, Any]) -> list[str]:
    """Which node ran each engine, and every attempt that did not answer (a Ray run)."""
    ex = report.get("executor") or {}
    if ex.get("kind") != "ray":
        return []
    lines = ["", f"## Where each engine ran (Ray cluster {ex.get('address')}, {len(ex.get('nodes', []))} node(s); "
             "node ids to 12 characters, whole in report.json)", "",
             "| case | cached engine's node | reference's node | attempts that did not answer |", "|---|---|---|---|"]
    for x in report["cases"]:
        where = x.get("placement") or {}
        cached, ref = where.get("cached") or {}, where.get("reference") or {}
        failed = [a.get("why", "") for w in (cached, ref) for a in w.get("attempts", []) if a.get("why")]
        ref_node = "reused" if ref.get("reused") else (ref.get("node") or "-")[:12]
        lines.append(f"| {x['name']} | {(cached.get('node') or '-')[:12]} | {ref_node} | {_cell('; '.join(failed))} |")
    return lines


def _differing_outputs(report: dict[str, Any]) -> list[str]:
    """What each engine answered where greedy tokens differ: the symptom a
    wrong hit shows (the cached engine answers like the base model)."""
    out: list[str] = []
    for case in report["cases"]:
        first = (case.get("verdict") or {}).get("first_difference")
        if not first:
            continue
        p = first["prompt"]
        ref = (case.get("reference") or {}).get("texts") or []
        got = (case.get("cached") or {}).get("texts") or []
        if p >= min(len(ref), len(got)):
            continue
        if not out:
            out = ["", "## Where tokens differ (prompt of the first difference)", "",
                   "| case | prompt | auto engine on the candidate | cached engine |", "|---|---|---|---|"]
        out.append(f"| {case['name']} | {p} | `{_cell(repr(ref[p]))}` | `{_cell(repr(got[p]))}` |")
    return out
