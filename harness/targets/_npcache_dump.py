"""Run vLLM's own first ``npcache`` load on a checkpoint: ``python -m harness.targets._npcache_dump CKPT``.

The dump is made by the function the engine calls,
``weight_utils.np_cache_weights_iterator``, over the ``.bin`` files vLLM's
``DefaultModelLoader._prepare_weights`` selects for ``npcache``; so the
``np/`` directory is byte for byte what a first ``--load-format npcache``
engine leaves behind, without starting an engine.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m harness.targets._npcache_dump CKPT", file=sys.stderr)
        return 2
    ckpt = argv[0]
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import np_cache_weights_iterator

    loader = DefaultModelLoader(LoadConfig(load_format="npcache"))
    folder, files, use_safetensors, _ = loader._prepare_weights(ckpt, None, None, True, None)
    if use_safetensors:
        print(f"{ckpt}: npcache reads only .bin files; vLLM found safetensors", file=sys.stderr)
        return 2
    names = [name for name, _ in np_cache_weights_iterator(ckpt, None, folder, files, False)]
    print(json.dumps({"tensors": len(names), "files": sorted(files)}), flush=True)
    sys.stderr.flush()
    os._exit(0)  # vLLM's atexit hooks can hold a finished process for a long while on CPU


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
