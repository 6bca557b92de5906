"""Serialize a checkpoint with vLLM's own helper: ``python -m harness.targets._tensorize CKPT OUT DTYPE``.

``tensorize_vllm_model`` starts an engine on CKPT and has its worker write
the loaded model to OUT (``TensorizerLoader.save_model``), the file a
``--load-format tensorizer`` engine reads; so OUT is what an operator gets
from vLLM's ``tensorize_vllm_model`` example, made by the same function.

One change: vLLM then copies the config and tokenizer beside OUT by
downloading them from the Hugging Face Hub under the served model name
(``serialize_extra_artifacts``), which a local checkpoint path is not and an
offline GPU host cannot reach; they are copied from CKPT instead. The engine
runs in this process (``uni`` executor, no engine-core process) so that the
replacement is the one the worker calls.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")


def _copy_artifacts(ckpt: Path, out_dir: Path) -> list[str]:
    copied = []
    for p in sorted(ckpt.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(p, out_dir / p.name)
            copied.append(p.name)
    return copied


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m harness.targets._tensorize CKPT OUT DTYPE", file=sys.stderr)
        return 2
    ckpt, out, dtype = Path(argv[0]), Path(argv[1]), argv[2]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: see the docstring
    # Optional dependency: vLLM (and through it tensorizer) is imported only here.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import tensorizer as vllm_tensorizer

    copied: list[str] = []

    def extra_artifacts(tensorizer_args: Any, served_model_name: Any, revision: Any = None) -> None:
        copied.extend(_copy_artifacts(ckpt, out.parent))

    vllm_tensorizer.serialize_extra_artifacts = extra_artifacts
    args = EngineArgs(model=str(ckpt), dtype=dtype, max_model_len=256, enforce_eager=True,
                      distributed_executor_backend="uni", gpu_memory_utilization=0.5)
    vllm_tensorizer.tensorize_vllm_model(args, vllm_tensorizer.TensorizerConfig(tensorizer_uri=str(out)))
    if not out.is_file():
        print(f"vLLM's tensorize_vllm_model returned without writing {out}", file=sys.stderr)
        return 1
    print(json.dumps({"file": str(out), "bytes": out.stat().st_size, "artifacts": copied}), flush=True)
    sys.stderr.flush()
    os._exit(0)  # vLLM's atexit hooks can hold a finished process for a long while on CPU


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
