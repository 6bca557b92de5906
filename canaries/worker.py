"""The shape every engine worker process shares: ``SPEC.json OUT.json`` in,
one JSON result out, then an exit that waits for nothing.

Two workers have it: the golden recorder (:mod:`canaries._record_worker`)
and the gate's engine (:mod:`harness.engine_worker`, which imports it from
here: canaries sits below harness). Spec and result are JSON files, never
pickle, so the parent and the engine share no Python objects.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def worker_main(module: str, argv: list[str], body: Callable[[dict[str, Any], str], dict[str, Any]]) -> int:
    """Run ``body(spec, out_path)`` for ``python -m MODULE SPEC.json OUT.json``.

    Writes what it returns to ``OUT.json`` (atomically), or, when it raises,
    ``{"ok": False, "error": "Type: message"}`` with the traceback on stderr:
    the caller needs the reason as data, not a traceback in a log. Then
    leaves with ``os._exit`` (0 for an ``ok`` result, 1 otherwise): vLLM's
    CPU engine-core children and atexit hooks sometimes hang at interpreter
    exit, the result is on disk, and the parent kills the process group.
    Returns 2, having printed the usage, only for a wrong argument count.
    """
    if len(argv) != 2:
        print(f"usage: python -m {module} SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        result = body(spec, argv[1])
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    from pgbase import atomic

    atomic.write_json(argv[1], result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)
