"""The rollout report: ``rollout.json`` for machines, ``rollout.md`` and ``rollout.html`` for people.

All three come from one document (:func:`build`): the outcome and the
failure (which replica, why, whether it is back on the old checkpoint as a
hit, whether the whole fleet is), each switch with its phase seconds, the
load generator's counts, the notes (memory, releases, eviction), and a
timeline: for each replica, the spans in which it served A, B, ... or
nothing, from the state file's entries. The HTML draws that timeline as an
inline SVG through the gate reports' Jinja environment
(:func:`harness.report.html.render_template`); every file is written
atomically (:mod:`pgbase.atomic`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.rollout.state import RolloutState
from pgbase import atomic

FORMAT = "preload-gate-rollout-report/1"
COLORS = ("#8c959f", "#0969da", "#1a7f37", "#8250df", "#bf8700", "#cf222e")
NOTHING_COLOR = "#eaeef2"
LABEL_W, CHART_W, ROW_H, ROW_GAP = 120, 640, 18, 8


def summary(state: RolloutState) -> dict[str, Any]:
    """The figures a report leads with: outcome, switch times, whole time."""
    ok = [x for x in state.switches if x.get("ok") and not x.get("rollback")]
    rollbacks = [x for x in state.switches if x.get("rollback")]
    return {
        "status": state.status,
        "exit_code": 0 if state.status == "done" else 1,
        "seconds": round(state.updated - state.created, 3),
        "switches_ok": len(ok),
        "switch_seconds": [x["seconds"].get("switch") for x in ok],
        "rollbacks": [{"replica": x["replica"], "ok": x["ok"], "seconds": x["seconds"].get("switch")}
                      for x in rollbacks],
        "failure": state.failure,
    }


def timeline(state: RolloutState) -> list[dict[str, Any]]:
    """Per replica, ``[{"serving": label, "start": s, "end": s}]`` in seconds from the rollout's start.

    A replica serves its checkpoint while its phase is ``serving`` and
    nothing otherwise (restarting, rolling back, down).
    """
    t0, t_end = state.created, max(state.updated, state.created)
    out = []
    for r in state.replicas:
        entries = [e for e in state.timeline if e.get("replica") == r.index]
        spans: list[dict[str, Any]] = []
        for i, e in enumerate(entries):
            start = float(e["t"]) - t0
            end = (float(entries[i + 1]["t"]) if i + 1 < len(entries) else t_end) - t0
            label = state.label(e.get("serving")) if e.get("phase") == "serving" else "nothing"
            if spans and spans[-1]["serving"] == label:
                spans[-1]["end"] = round(max(end, start), 3)
            else:
                spans.append({"serving": label, "start": round(start, 3), "end": round(max(end, start), 3)})
        out.append({"replica": r.index, "url": r.url, "spans": spans})
    return out


def build(state: RolloutState, loadgen: dict[str, Any] | None = None,
          evidence: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report document."""
    checkpoints = [{"label": state.label(c.key), "path": c.path, "digest": c.digest, "key": c.key,
                    "golden": c.golden} for c in state.sequence]
    return {"format": FORMAT, "id": state.id, "host": state.host, "summary": summary(state),
            "checkpoints": checkpoints, "settings": state.settings, "driver": state.driver,
            "replicas": [{"index": r.index, "url": r.url, "serving": state.label(r.serving), "phase": r.phase}
                         for r in state.replicas],
            "switches": state.switches, "daemons": [d.__dict__ for d in state.daemons], "notes": state.notes,
            "loadgen": loadgen, "evidence": evidence or [], "timeline": timeline(state)}


def headline(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    last = doc["checkpoints"][-1]["label"]
    if s["status"] == "done":
        return f"DONE: every replica serves {last} ({s['seconds']:.0f} s)"
    f = s.get("failure") or {}
    who = f"replica {f['replica']} ({f.get('url')})" if f.get("replica") is not None else "the rollout"
    rb = f.get("rollback") or {}
    back = (f"; replica {f['replica']} is back on {_from_label(doc)}" + (" as a hit" if rb.get("hit") else "")
            if rb.get("ok") else "")
    if s["status"] == "running":
        return "RUNNING (or stopped mid-way): run the same command again to continue"
    return f"FAILED: {who} on {f.get('onto')}: {f.get('reason')}: {f.get('detail', '')[:400]}{back}; {f.get('fleet')}"


def _from_label(doc: dict[str, Any]) -> str:
    f = doc["summary"].get("failure") or {}
    labels = [c["label"] for c in doc["checkpoints"]]
    onto = f.get("onto")
    return labels[labels.index(onto) - 1] if onto in labels and labels.index(onto) > 0 else labels[0]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: dict[str, Any]) -> str:
    lines = [f"# preload-gate rollout {doc['id']} on {doc['host']}", "", f"**{headline(doc)}**", "",
             "| checkpoint | path | digest |", "|---|---|---|"]
    lines += [f"| {c['label']} | `{c['path']}` | `{c['digest'][:16]}` |" for c in doc["checkpoints"]]
    lines += ["", "## Switches (seconds: restart, ready, canary; switch = stop to canary pass)", "",
              "| replica | onto | rollback | ok | reason | restart | ready | canary | switch | detail |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for x in doc["switches"]:
        sec = x.get("seconds") or {}
        lines.append(f"| {x['replica']} | {x['onto']} | {'yes' if x.get('rollback') else ''} | "
                     f"{'ok' if x['ok'] else '**FAILED**'} | {x.get('reason') or ''} | {sec.get('restart', '')} | "
                     f"{sec.get('ready', '')} | {sec.get('canary', '')} | {sec.get('switch', '')} | "
                     f"{_cell(x.get('detail', ''))[:200]} |")
    lg = doc.get("loadgen")
    if lg:
        lines += ["", "## Load during the rollout", "",
                  f"- requests answered {lg['answered']} (by checkpoint: {lg['by_checkpoint']}), refused {lg['refused']}, "
                  f"**wrong {lg['wrong']}** (an answer matching no checkpoint's golden), near-ties {lg['near_ties']}, "
                  f"over {lg['seconds']:.0f} s"]
    lines += ["", "## Timeline (seconds from the start)", "", "| replica | spans |", "|---|---|"]
    for row in doc["timeline"]:
        spans = ", ".join(f"{s['serving']} {s['start']:.0f}-{s['end']:.0f}" for s in row["spans"])
        lines.append(f"| {row['replica']} | {spans} |")
    if doc["notes"] or doc["evidence"]:
        lines += ["", "## Notes", ""]
        lines += [f"- gate report {e['report']} accepted for {e['digest'][:16]} (golden {e['golden']}; cases "
                  f"{', '.join(e['cases'])})" for e in doc["evidence"]]
        lines += [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def chart(doc: dict[str, Any]) -> dict[str, Any]:
    """SVG geometry of the timeline: one row per replica, one colored bar per span."""
    colors = {c["label"]: COLORS[i % len(COLORS)] for i, c in enumerate(doc["checkpoints"])}
    colors["nothing"] = NOTHING_COLOR
    end = max((s["end"] for row in doc["timeline"] for s in row["spans"]), default=1.0) or 1.0
    scale = CHART_W / end
    rows = []
    for k, row in enumerate(doc["timeline"]):
        y = k * (ROW_H + ROW_GAP)
        bars = [{"x": LABEL_W + s["start"] * scale, "w": max(0.5, (s["end"] - s["start"]) * scale),
                 "color": colors.get(s["serving"], "#000"),
                 "title": f"{s['serving']}: {s['start']:.1f}-{s['end']:.1f} s"} for s in row["spans"]]
        rows.append({"y": y, "label": f"replica {row['replica']}", "bars": bars})
    step = next(v for v in (5, 10, 30, 60, 120, 300, 600, 1800) if end / v <= 12)
    ticks = [{"x": LABEL_W + v * scale, "label": f"{v}"} for v in range(0, int(end) + 1, step)]
    height = max(1, len(rows)) * (ROW_H + ROW_GAP) + 24
    return {"rows": rows, "ticks": ticks, "height": height, "width": LABEL_W + CHART_W + 40,
            "axis_y": height - 20, "row_h": ROW_H, "legend": list(colors.items())}


def render_html(doc: dict[str, Any]) -> str:
    from harness.report.html import render_template

    return render_template("rollout.html.j2", doc=doc, headline=headline(doc), chart=chart(doc))


def write_report(doc: dict[str, Any], directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write rollout.{json,md,html} into ``directory``; returns their paths."""
    out = Path(directory)
    paths = {"json": out / "rollout.json", "md": out / "rollout.md", "html": out / "rollout.html"}
    atomic.write_json(paths["json"], doc)
    atomic.write_text(paths["md"], render_markdown(doc))
    atomic.write_text(paths["html"], render_html(doc))
    return paths
