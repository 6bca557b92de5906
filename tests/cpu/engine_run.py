"""Run one vLLM engine in this process and print its greedy tokens as JSON.

``python engine_run.py '{"model": ..., "load_format": ..., "extra": {...}, "tp": 1, "engine_args": {...}}'``
Used by the loader tests: every engine runs in its own subprocess (vLLM's
CPU build spawns workers; a crash must fail a test, not the test runner).
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = ["The capital of France is", "1 2 3 4", "Hello, my name is", "def fib(n):"]


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("write_weight"):
        # Keep the engine core in this process so apply_model can reach the
        # model without shipping a function anywhere.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec["model"], load_format=spec.get("load_format", "auto"), dtype=spec.get("dtype", "auto"),
        tensor_parallel_size=spec.get("tp", 1), max_model_len=256, enforce_eager=True,
        gpu_memory_utilization=0.1, seed=0,
    )
    kwargs.update(spec.get("engine_args") or {})  # other EngineArgs, as given
    if spec.get("extra") is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    start = time.perf_counter()
    llm = LLM(**kwargs)
    ready = time.perf_counter() - start
    if spec.get("write_weight"):
        # Simulate a buggy engine writing into a mapped weight (zero-copy).
        name = spec["write_weight"]

        def write(model):
            dict(model.named_parameters())[name].data.fill_(0.5)

        llm.apply_model(write)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    print("RESULT " + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "ready_s": ready,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
