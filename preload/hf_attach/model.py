"""The transformers model a daemon's raw-stage tensors go into.

Built from ``config.json`` with parameters on the meta device (no memory,
no init), then the tensors are put in place by checkpoint name and weights
tied; with tensor parallelism, transformers' own plan decides the
placeholders and this rank's slices become their local shards. Shape
mismatches are refused by tensor name (:class:`AttachError`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pgbase.errors import PreloadGateError
from preload.meta_model import build_meta_model


class AttachError(PreloadGateError):
    """The daemon's tensors do not fit the model built from the config."""


def place_tensors(model: Any, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> None:
    """Put ``tensors`` (checkpoint names) in place of the model's meta
    parameters, tie weights, and check nothing is left on meta."""
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unexpected = sorted(n for n in tensors if n not in named and n not in buffers)
    if unexpected:
        raise AttachError(
            f"the daemon serves {len(unexpected)} tensors this model has no place for "
            f"({', '.join(unexpected[:5])}); is the daemon serving this checkpoint at stage raw?"
        )
    for name, tensor in {**tensors, **{a: tensors[c] for a, c in (aliases or {}).items() if c in tensors}}.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            expect = owner._parameters[leaf]
            if tuple(expect.shape) != tuple(tensor.shape):
                raise AttachError(
                    f"tensor {name}: the daemon serves shape {tuple(tensor.shape)}, "
                    f"the model built from config.json wants {tuple(expect.shape)}"
                )
            owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor
    tie = getattr(model, "tie_weights", None)  # transformers models; a plain nn.Module has none
    if tie is not None:
        tie()
    left = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta)
    if left:
        raise AttachError(
            f"{len(left)} parameters got no tensor from the daemon ({', '.join(left[:5])}); "
            "the checkpoint lacks them and they are not tied"
        )


def tp_mesh(device: torch.device, tp_size: int) -> Any:
    """The 1-D device mesh a ``tp_size``-way transformers engine shards on
    (what ``from_pretrained(tp_plan="auto")`` builds: the whole world)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (tp_size,))


def build_tp_model(checkpoint: str | os.PathLike[str], mesh: Any, tp_size: int) -> Any:
    """The meta model with transformers' own tensor-parallel plan applied:
    its parameters become DTensor placeholders (placements as transformers
    sets them) and its modules get transformers' forward hooks."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = build_meta_model(checkpoint)
    apply_tensor_parallelism(model, mesh)
    model._device_mesh = mesh
    model._tp_size = tp_size
    try:
        from transformers.distributed import DistributedConfig

        model.config.distributed_config = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    except (ImportError, TypeError, ValueError):
        pass
    return model


def place_tp_tensors(model: Any, tensors: dict[str, torch.Tensor], mesh: Any, tp_size: int, tp_rank: int) -> None:
    """Put this rank's slices where transformers' placeholders are: a
    sharded parameter becomes ``DTensor.from_local`` of our slice with the
    placeholder's own placements, global shape and stride. A slice whose
    split differs from the placeholder's is refused by name."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from preload.daemon.tp_slice import chunk

    named = dict(model.named_parameters(remove_duplicate=False))
    unexpected = sorted(n for n in tensors if n not in named)
    if unexpected:
        raise AttachError(f"the daemon serves {len(unexpected)} tensors this model has no place for "
                          f"({', '.join(unexpected[:5])})")
    for name, local in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        expect = owner._parameters[leaf]
        if isinstance(expect, DTensor):
            placements = tuple(expect.placements)
            if len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
                raise AttachError(f"tensor {name}: transformers places it as {placements}; only Shard/Replicate "
                                  "can be served from the raw stage")
            pl = placements[0]
            want = tuple(expect.shape) if isinstance(pl, Replicate) else tuple(
                chunk(torch.empty(tuple(expect.shape), device="meta"), pl.dim, tp_size, tp_rank).shape)
            if tuple(local.shape) != want:
                raise AttachError(f"tensor {name}: the daemon serves a slice of shape {tuple(local.shape)}; "
                                  f"transformers places it as {pl} of {tuple(expect.shape)}, rank {tp_rank} "
                                  f"holds {want}: the daemon and this engine split differently")
            value: torch.Tensor = DTensor.from_local(local, mesh, placements, run_check=False,
                                                     shape=expect.shape, stride=expect.stride())
        else:
            if tuple(expect.shape) != tuple(local.shape):
                raise AttachError(f"tensor {name}: the daemon serves shape {tuple(local.shape)}, "
                                  f"the model wants {tuple(expect.shape)} (replicated on every rank)")
            value = local
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    left = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta)
    if left:
        raise AttachError(f"{len(left)} parameters got no tensor from the daemon ({', '.join(left[:5])})")
