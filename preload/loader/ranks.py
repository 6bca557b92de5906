"""Where this engine rank sits, as vLLM's parallel groups and config say.

The daemon numbers its sockets by global rank
(``preload.daemon.placement``); an engine rank finds its own from vLLM's
tensor- and pipeline-parallel groups and its data-parallel config.
"""

from __future__ import annotations

from typing import Any


def rank_info() -> dict[str, int]:
    """This process's ``tp_size``, ``tp_rank``, ``pp_size``, ``pp_rank``
    from vLLM's initialised parallel groups (imports vLLM)."""
    from vllm.distributed import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pp = get_pp_group()
    return {"tp_size": get_tensor_model_parallel_world_size(), "tp_rank": get_tensor_model_parallel_rank(),
            "pp_size": pp.world_size, "pp_rank": pp.rank_in_group}


def global_rank_of(vllm_config: Any, ranks: dict[str, int]) -> tuple[int, int]:
    """(global rank as the daemon numbers it, DP replica of this engine).

    vLLM resets ``data_parallel_rank`` to 0 in each engine core of a dense
    model (its DP replicas are independent, each holding all weights) and
    keeps the replica in ``data_parallel_index``: the socket follows the
    former, the event reports the latter, so every replica's event is told
    apart.
    """
    pc = vllm_config.parallel_config
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    replica = getattr(pc, "data_parallel_index", None)
    replica = dp_rank if replica is None else int(replica)
    return (dp_rank * ranks["pp_size"] + ranks["pp_rank"]) * ranks["tp_size"] + ranks["tp_rank"], replica


