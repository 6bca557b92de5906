"""The golden-recording engine, in its own process.

Run by :func:`canaries.golden.record` as
``python -m canaries._record_worker SPEC.json OUT.json``: an ``auto`` vLLM
engine (weights read from disk) answers the canary prompts greedily. Spec
and result are JSON files, never pickle. vLLM's CPU build spawns workers,
so everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import sys
from typing import Any

from canaries.worker import worker_main


def _record(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.inputs import TokensPrompt

    s = spec["sampling"]
    kwargs: dict[str, Any] = {}
    # The deployment's settings (preload.deployment), where they leave vLLM's defaults.
    for name, default in (("tensor_parallel_size", 1), ("pipeline_parallel_size", 1), ("quantization", None),
                          ("kv_cache_dtype", "auto")):
        if spec.get(name, default) != default:
            kwargs[name] = spec[name]
    llm = LLM(
        model=spec["model"],
        load_format="auto",
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        seed=0,
        **kwargs,
    )
    tokenizer = llm.get_tokenizer()
    # The OpenAI server tokenizes a text prompt with special tokens added;
    # do the same here, and store the ids so the check sends these exact ids.
    prompt_ids = [list(tokenizer.encode(p)) for p in spec["prompts"]]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=s["max_tokens"],
        logprobs=s["top_logprobs"],
        ignore_eos=s["ignore_eos"],
        repetition_penalty=s["repetition_penalty"],
        presence_penalty=s["presence_penalty"],
        frequency_penalty=s["frequency_penalty"],
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False)
    prompts, seen = [], set()
    for text, ids, out in zip(spec["prompts"], prompt_ids, outputs, strict=True):
        comp = out.outputs[0]
        token_ids = [int(t) for t in comp.token_ids]
        steps = comp.logprobs or []
        if len(steps) != len(token_ids) or any(step is None for step in steps):
            raise RuntimeError(f"engine returned logprobs for {len(steps)} of {len(token_ids)} tokens")
        top = [{str(int(t)): float(lp.logprob) for t, lp in step.items()} for step in steps if step]
        chosen = [float(step[t].logprob) for t, step in zip(token_ids, steps, strict=True) if step]
        seen.update(token_ids)
        seen.update(int(t) for step in top for t in step)
        prompts.append({
            "prompt": text, "prompt_token_ids": ids, "token_ids": token_ids,
            "text": comp.text, "token_logprobs": chosen, "top_logprobs": top,
        })
    token_texts = {str(t): tokenizer.decode([t]) for t in sorted(seen)}
    from preload.deployment import resolved_dtype

    return {"ok": True, "vllm_version": vllm_version, "prompts": prompts, "token_texts": token_texts,
            "resolved_dtype": resolved_dtype(llm)}


def main(argv: list[str]) -> int:
    return worker_main("canaries._record_worker", argv, lambda spec, _out: _record(spec))


if __name__ == "__main__":
    main(sys.argv[1:])
