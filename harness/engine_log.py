"""What vLLM's own log says of an engine's start, as figures (harness.engine
reads it from each engine's log)."""

from __future__ import annotations

import re

# vLLM 0.33's start-up lines (v1/worker/gpu_model_runner.py, gpu_worker.py,
# v1/core/kv_cache_utils.py, v1/engine/core.py), as figures.
_FIGURES = (
    ("model_loading_gib", "model_loading_s",
     re.compile(r"Model loading took ([0-9.]+) GiB memory and ([0-9.]+) seconds")),
    ("kv_cache_gib", None, re.compile(r"Available KV cache memory: (-?[0-9.]+) GiB")),
    ("kv_cache_tokens", None, re.compile(r"KV cache size: ([0-9,]+) tokens")),
    ("init_engine_s", "compile_s",
     re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s(?: \(compilation: ([0-9.]+) s)?")),
)


def vllm_start_figures(log: str) -> dict[str, float]:
    """What vLLM logged of an engine's start: ``model_loading_gib``,
    ``model_loading_s``, ``kv_cache_gib``, ``kv_cache_tokens``,
    ``init_engine_s`` (profile, KV cache, warm-up) and ``compile_s``; the
    first of each line (rank 0's), absent where vLLM did not say it."""
    out: dict[str, float] = {}
    for first, second, rx in _FIGURES:
        m = rx.search(log)
        if m is None:
            continue
        out[first] = float(m.group(1).replace(",", ""))
        if second is not None and m.lastindex and m.lastindex >= 2 and m.group(2) is not None:
            out[second] = float(m.group(2))
    return out
