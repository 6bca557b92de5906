"""Extract WeightCacheKey's field names from vLLM's protocol.py, and EngineArgs' from arg_utils.py (no import)."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

PROTOCOL = "vllm/model_executor/model_loader/weight_cache/protocol.py"


def key_fields(source: str) -> list[str]:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "WeightCacheKey":
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    raise LookupError("no class WeightCacheKey in protocol.py")


def from_wheel(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return key_fields(z.read(PROTOCOL).decode())


ARG_UTILS = "vllm/engine/arg_utils.py"


def engine_args_fields(source: str) -> list[str]:
    """The annotated fields of ``EngineArgs`` in ``arg_utils.py``'s source: every setting an engine takes."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    raise LookupError("no class EngineArgs in arg_utils.py")


def installed_engine_args() -> list[str] | None:
    """``engine_args_fields`` of the installed vLLM, read as a file (vLLM is not imported); None without it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return engine_args_fields((Path(spec.origin).parent / "engine" / "arg_utils.py").read_text())
