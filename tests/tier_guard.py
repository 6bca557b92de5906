"""The unit tier runs without vLLM, and says so when it cannot.

``tox -e unit`` sets ``PRELOAD_GATE_UNIT_NO_VLLM=1``: the env is meant to
prove that every ``unit`` test passes where vLLM is not installed (DESIGN:
``preload``'s non-vLLM parts import without it). If vLLM is importable there
anyway (an extra pulled it in, a stale env), every test that skips or
branches on vLLM would silently take the vLLM path, and the run would prove
nothing. ``tests/conftest.py`` refuses such a session before collection.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

NO_VLLM_ENV = "PRELOAD_GATE_UNIT_NO_VLLM"


def vllm_presence_problem(environ: Mapping[str, str] = os.environ,
                          find_spec: Callable[[str], Any] = importlib.util.find_spec) -> str | None:
    """Why this session must not run (vLLM importable where ``NO_VLLM_ENV``
    says it is absent), or None."""
    if environ.get(NO_VLLM_ENV) != "1":
        return None
    spec = find_spec("vllm")
    if spec is None:
        return None
    return (f"{NO_VLLM_ENV}=1 (tox -e unit) says this env has no vLLM, but vllm imports from "
            f"{spec.origin or spec.submodule_search_locations}; the unit tier must run without it: "
            f"uninstall vllm here or recreate the env (tox -r -e unit)")
