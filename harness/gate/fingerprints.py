"""The fingerprint matrix: each anchor scheme's verdict on base vs candidate.

A report row shows, per mutation, which schemes call the candidate equal to
the base; the gate computes it while it prepares each case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pgbase.oscause import reason
from preload.identity import anchors

# header_only fingerprints come from the installed vLLM ("auto"); unit tests
# without vLLM use the labelled reimplementation ("reimpl").
HEADER_IMPL = "auto"


def fingerprint_matrix(base: Path, candidate: Path,
                       base_prints: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each anchor scheme's equality for base vs candidate (the report's matrix).

    ``base_prints`` are the base's fingerprints taken earlier (an in-place
    case overwrites the base, so its prints are taken before the edit)."""
    out: dict[str, dict[str, Any]] = {}
    for scheme in anchors.SCHEMES:
        try:
            b = base_prints[scheme] if base_prints else scheme_print(scheme, base)
            c = scheme_print(scheme, candidate)
            out[scheme] = {"equal": b == c}
        except Exception as exc:  # a scheme that cannot run is shown, not hidden
            out[scheme] = {"equal": None, "error": reason(exc)}
    return out


def all_prints(path: Path) -> dict[str, str]:
    """Every scheme's fingerprint of ``path``, hex, by scheme name."""
    return {s: scheme_print(s, path) for s in anchors.SCHEMES}


def scheme_print(scheme: str, path: Path) -> str:
    """One scheme's fingerprint of ``path``, hex."""
    opts: dict[str, Any] = {"implementation": HEADER_IMPL} if scheme == "header_only" else {}
    return anchors.fingerprint(scheme, path, **opts).hex
