"""Extract WeightCacheKey's field names from vLLM's protocol.py source (no import)."""

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
