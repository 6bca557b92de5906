"""A checkpoint's ``config.json``: read once, in the shape vLLM can use, and
digested in canonical form (the cache key's ``config_digest``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pgbase.errors import CheckpointError
from pgbase.oscause import describe


def read_config(checkpoint: str | os.PathLike[str]) -> Any:
    """The parsed ``config.json`` of ``checkpoint``, or None when it has none.

    Raises :class:`CheckpointError` when it is not readable JSON, not a JSON
    object, or its ``architectures`` is not a list of class names: the shape
    transformers' ``PretrainedConfig`` declares (``architectures: list[str]``)
    and vLLM's model registry iterates."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"config.json cannot be read: {describe(exc, path)}") from exc
    except ValueError as exc:
        raise CheckpointError(f"config.json is not readable JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a JSON {type(obj).__name__}, not an object; "
                              "restore the checkpoint's config.json")
    archs = obj.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise CheckpointError(f"{path}: architectures is {json.dumps(archs)[:80]}, not a list of model class "
                              'names (e.g. ["LlamaForCausalLM"]); fix config.json')
    return obj


def config_digest(checkpoint: str | os.PathLike[str]) -> str | None:
    """SHA-256 of ``config.json`` in canonical form (sorted keys, no spaces)."""
    obj = read_config(checkpoint)
    return None if obj is None else canonical_digest(obj)


def canonical_digest(obj: Any) -> str:
    """The digest :func:`config_digest` gives a config already read
    (``status`` reads config.json once and takes every key field from it)."""
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: a lone surrogate escape ("\\ud800") is valid JSON and
    # must hash, not crash; every other string encodes as plain UTF-8.
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def first_architecture(cfg: Any) -> str:
    """The model class a raw-stage key names: the first of ``architectures``
    ("" without one). ``cfg`` is :func:`read_config`'s answer."""
    archs = (cfg or {}).get("architectures") or [""]
    return str(archs[0])
