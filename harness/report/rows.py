"""The per-case summary every report format shows, derived once from report.json."""

from __future__ import annotations

from typing import Any


def outcome(case: dict[str, Any]) -> str:
    """The load outcome the cached engine recorded ("hit", "miss", "none", or "-" if not run)."""
    verdict = case.get("verdict") or {}
    if case["status"] == "NOT_RUN":
        return "-"
    if not verdict.get("outcome") and any(d.startswith("note: no load event") for d in verdict.get("details") or []):
        return "unproven"  # a cache that records nothing (npcache, sharded_state)
    return verdict.get("outcome") or "none"


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in report["cases"]:
        verdict = c.get("verdict") or {}
        detail = "; ".join(verdict.get("details") or []) or c.get("not_run_reason") or ""
        events = (c.get("cached") or {}).get("events") or []
        misses = sorted({str(e.get("reason")) for e in events if e.get("outcome") != "hit"})
        if misses:  # a loud miss says why; show it beside the verdict
            detail = "; ".join(filter(None, [detail, "load: " + "; ".join(misses)]))
        kc = c.get("key_check")
        if kc:
            mark = "ok" if kc["ok"] else "FAILED"
            detail = (detail + "; " if detail else "") + (
                f"key check {mark}: mismatched {', '.join(kc['mismatched_fields']) or 'nothing'}"
            )
        ref, cached = c.get("reference") or {}, c.get("cached") or {}
        tokens = ""
        if ref.get("ok") and cached.get("ok"):
            same = ref["token_ids"] == cached["token_ids"]
            tokens = "equal" if same else "differ"
        rows.append(
            {
                "name": c["name"],
                "description": c["description"],
                "expect": c["expect"],
                "outcome": outcome(c),
                "status": c["status"],
                "reasons": ", ".join(verdict.get("reasons") or []),
                "tokens": tokens,
                "detail": detail,
            }
        )
    return rows
