"""Save one rank's sharded state BEFORE weight processing:
``python -m harness.targets._sharded_save CKPT OUT TP RANK INIT_METHOD DTYPE``.

vLLM's own way to make a sharded state (``save_sharded_state`` on a running
engine) saves the model after ``process_weights_after_loading``; on CPU that
processing packs Linear weights into kernel handles and leaves the
parameters empty, so the saved state has no Linear weights. This worker
builds the rank's model the way the daemon's ``loaded`` stage does
(:mod:`preload.daemon.loaded`: EngineArgs -> VllmConfig, a gloo world of TP
ranks, the loader's ``create_model`` and ``load_weights``) and calls vLLM's
``ShardedStateLoader.save_model`` on it before any processing. The files
are what ``--load-format sharded_state`` reads: ``model-rank-{rank}-part-{part}.safetensors``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    ckpt, out, tp_s, rank_s, init, dtype = argv
    tp, rank = int(tp_s), int(rank_s)
    import torch

    torch.set_num_threads(1)
    # vLLM's CPU communicator names its shared-memory group by this, one per group.
    os.environ.setdefault("VLLM_DIST_IDENT", "pgs" + init.rsplit(":", 1)[-1])
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = EngineArgs(model=ckpt, tensor_parallel_size=tp, dtype=dtype, max_model_len=256,
                             enforce_eager=True, load_format="auto",
                             distributed_executor_backend="mp").create_engine_config()
    model_config = vllm_config.model_config
    init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=init, local_rank=rank,
                                 backend=current_platform.dist_backend)
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(tp, 1)
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("cpu"):
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
            loader.load_weights(model, model_config)
        ShardedStateLoader.save_model(model, out)
    print(f"rank {rank}: saved", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
