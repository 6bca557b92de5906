"""The golden canary file a passing promotion gate records for the deploy.

The report names the golden's SHA-256 beside its path, so whoever believes
the report (``preload-gate rollout``) can tell that a golden file is the one
this gate recorded, not one copied in from elsewhere.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from harness.gate.cases import gate_settings
from harness.gate.options import GateOptions
from pgbase.errors import PreloadGateError


def record_golden(opts: GateOptions, candidate: Path) -> dict[str, Any]:
    """Record the canary golden file for the promoted candidate, if canaries exist."""
    try:
        from canaries.golden import record
    except ImportError as exc:
        return {"recorded": False, "note": f"canaries.golden.record is not available ({exc})"}
    if not opts.report_dir:
        return {"recorded": False, "note": "no --report DIR: the golden canary file was not recorded"}
    out = Path(opts.report_dir) / "golden.json"
    opts.note("golden", f"recording the canary golden file {out}")
    try:
        d = gate_settings(opts)
        record(str(candidate), out, settings=d)
    except PreloadGateError as exc:
        return {"recorded": False, "note": f"golden recording failed: {exc}"}
    return {"recorded": True, "path": str(out), "settings": d.to_json(),
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
