"""A rank's weights from the checkpoint's shards: the fallback when a daemon misses.

Split by the same rule the daemon uses (:mod:`preload.daemon.tp_slice`), so
a fallback rank holds exactly what its daemon would have served.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from preload.hf_attach.model import (
    build_tp_model,
    place_tensors,
    place_tp_tensors,
)
from preload.meta_model import build_meta_model


def disk_rank_tensors(
    checkpoint: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's tensors read from the checkpoint's shards, split by the
    same rule the daemon uses (``preload.daemon.tp_slice``): a fallback
    rank holds exactly what its daemon would have served."""
    from safetensors import safe_open

    from pgbase.shards import shard_paths
    from preload.daemon.tp_slice import chunk, plan_slices

    out: dict[str, torch.Tensor] = {}
    for path in shard_paths(checkpoint):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            slices = plan_slices(checkpoint, [(n, f.get_slice(n).get_shape()) for n in names], tp_size, tp_rank)
            for n in names:
                full = f.get_tensor(n)
                sl = slices[n]
                part = full if sl.dim is None else chunk(full, sl.dim, tp_size, tp_rank)
                out[n] = part.contiguous().to(device)
    return out


def disk_model(
    checkpoint: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0, mesh: Any = None
) -> Any:
    """The same model as :func:`attach_model` builds, weights from disk
    (this rank only: no collective, so other ranks may stay attached)."""
    tensors = disk_rank_tensors(checkpoint, device, tp_size, tp_rank)
    if tp_size > 1:
        model = build_tp_model(checkpoint, mesh, tp_size)
        place_tp_tensors(model, tensors, mesh, tp_size, tp_rank)
    else:
        model = build_meta_model(checkpoint)
        place_tensors(model, tensors)
    return model.to(device)
