"""The prompt set: a handful of short, varied prompts, for canaries and the gate.

Greedy decoding over several contexts (prose, code, a counting pattern, a
question) reaches more of the weights than one prompt would, and a handful
keeps a canary check to a second or two per replica. The gate's engines
(:data:`harness.engine.EngineSpec.prompts`) use the same set, so the golden a
passing promotion gate records is answered on the prompts the gate compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from canaries.errors import GoldenError

DEFAULT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water?\nA:",
)


def load_prompts(path: str | Path) -> tuple[str, ...]:
    """Prompts from a file: a JSON list of strings (``.json``), else one per line.

    Blank lines are dropped; an empty set is an error, not a vacuous pass.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise GoldenError(f"cannot read prompts file {p}: {exc.strerror or exc}") from exc
    if p.suffix == ".json":
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise GoldenError(f"prompts file {p} is not JSON: {exc}") from exc
        if not isinstance(obj, list) or not all(isinstance(s, str) for s in obj):
            raise GoldenError(f"prompts file {p} must hold a JSON list of strings")
        prompts = tuple(s for s in obj if s.strip())
    else:
        prompts = tuple(line for line in text.splitlines() if line.strip())
    if not prompts:
        raise GoldenError(f"prompts file {p} holds no prompt")
    return prompts
