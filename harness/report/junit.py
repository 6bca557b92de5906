"""report.xml: JUnit XML, one testcase per case, for any CI's test view.

Mapping: PASS -> a plain testcase; BLOCK -> ``<failure>`` whose type is the
first reason; NOT_RUN -> ``<skipped>`` with the reason (a CI shows it as
skipped, never as passed); an engine error -> ``<error>``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any


def render_junit(report: dict[str, Any]) -> str:
    cases = report["cases"]
    suites = ET.Element("testsuites", name="preload-gate")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"preload-gate.{report['mode']}.{report['target']}",
        tests=str(len(cases)),
        failures=str(sum(1 for c in cases if c["status"] == "BLOCK" and _reasons(c) != ["error"])),
        errors=str(sum(1 for c in cases if c["status"] == "BLOCK" and _reasons(c) == ["error"])),
        skipped=str(sum(1 for c in cases if c["status"] == "NOT_RUN")),
        time=f"{report['seconds']:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for k in ("candidate", "base", "target", "verdict", "vllm_version"):
        ET.SubElement(props, "property", name=k, value=str(report.get(k)))
    for c in cases:
        wall = sum(float((c.get(k) or {}).get("timings", {}).get("wall", 0.0)) for k in ("cached",))
        tc = ET.SubElement(suite, "testcase", classname=f"preload-gate.{report['target']}",
                           name=c["name"], time=f"{wall:.3f}")
        details = "\n".join((c.get("verdict") or {}).get("details") or [])
        if c["status"] == "NOT_RUN":
            ET.SubElement(tc, "skipped", message=f"not run: {c.get('not_run_reason', '')}")
        elif c["status"] == "BLOCK":
            reasons = _reasons(c)
            tag = "error" if reasons == ["error"] else "failure"
            el = ET.SubElement(tc, tag, message=", ".join(reasons), type=reasons[0] if reasons else "block")
            el.text = details
        out = ET.SubElement(tc, "system-out")
        out.text = f"expected {c['expect']}; {c['description']}"
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _reasons(case: dict[str, Any]) -> list[str]:
    return list((case.get("verdict") or {}).get("reasons") or [])
