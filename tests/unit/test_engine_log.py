"""vLLM's start-up lines read as figures (harness.engine_log), the lines as vLLM 0.33 writes them."""

from __future__ import annotations

import pytest

from harness.engine_log import vllm_start_figures

pytestmark = pytest.mark.unit

LOG = """INFO gpu_model_runner.py:5089] Model loading took 7.68 GiB memory and 5.183000 seconds
INFO gpu_worker.py:773] Available KV cache memory: 124.86 GiB
INFO kv_cache_utils.py:1148] GPU KV cache size: 1,090,768 tokens, maximum concurrency 4260.81x
INFO core.py:406] init engine (profile, create kv cache, warmup model) took 41.02 s (compilation: 30.50 s)
"""


def test_each_line_is_its_figure() -> None:
    assert vllm_start_figures(LOG) == {"model_loading_gib": 7.68, "model_loading_s": 5.183, "kv_cache_gib": 124.86,
                                       "kv_cache_tokens": 1090768.0, "init_engine_s": 41.02, "compile_s": 30.5}


def test_eager_has_no_compile_figure_and_other_text_none() -> None:
    eager = "INFO core.py:413] init engine (profile, create kv cache, warmup model) took 3.20 s\n"
    assert vllm_start_figures(eager) == {"init_engine_s": 3.2}
    assert vllm_start_figures("Loading weights took 1.0 seconds\n") == {}  # control: a line it does not read
