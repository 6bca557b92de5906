"""Tensor-parallel slices for the raw stage: each rank holds only its part.

The split is the consuming engine's, not ours. For a transformers model
that is the model's tensor-parallel plan (``model.tp_plan``: the class's
``_tp_plan`` plus the config's ``base_model_tp_plan``, read from a model
built on the meta device) matched to tensor names by transformers' own
matcher, and each style's placement as transformers 5.x places it in
``ColwiseParallel.shard_param`` / ``RowwiseParallel.shard_param``:

==================================  =======================  ==============
style (class)                       weight                   bias
==================================  =======================  ==============
``ColwiseParallel`` (colwise,       ``Shard(ndim - 2)``;     ``Shard(0)``
colwise_rep, colwise_gather_output) Embedding ``Shard(1)``
``RowwiseParallel`` (rowwise,       ``Shard(ndim - 1)``;     replicated
rowwise_rep, embedding_rowwise...)  Embedding ``Shard(0)``
``SequenceParallel``, styles that   replicated               replicated
shard no parameter
not in the plan                     replicated               replicated
==================================  =======================  ==============

Any other style (packed, MoE, MLA...) is refused by name. A ``Shard(d)``
rank holds ``torch.chunk(full, tp_size, d)[rank]`` (DTensor's own split;
an empty slice past the last chunk). ``tests/cpu/test_tp_slice.py``
compares every rank's slice with what ``from_pretrained(tp_plan="auto")``
holds on that rank (gloo, two processes), so a transformers release that
places differently fails that test instead of serving other slices.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pgbase.errors import CheckpointError
from preload.meta_model import build_meta_model

REPLICATE = None


class TpSliceError(CheckpointError):
    """The checkpoint cannot be split the way its engine would split it."""


@dataclass(frozen=True)
class Slice:
    """How one tensor is split: ``dim`` None means every rank holds it whole."""

    name: str
    style: str | None
    dim: int | None

    def local_shape(self, shape: Sequence[int], tp_size: int, rank: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        return tuple(chunk(torch.empty(tuple(shape), device="meta"), self.dim, tp_size, rank).shape)


def chunk(full: torch.Tensor, dim: int, tp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split on ``dim``, as DTensor's
    ``Shard(dim)`` splits it (``torch.chunk``; empty past the last chunk)."""
    parts = torch.chunk(full, tp_size, dim)
    if rank < len(parts):
        return parts[rank]
    return full.narrow(dim, full.shape[dim], 0)


def _matcher() -> Any:
    """transformers' own plan matcher (renamed between 5.17 and 5.19)."""
    from transformers.distributed import tensor_parallel as tp

    for name in ("_get_parameter_plan", "_get_parameter_tp_plan"):
        fn = getattr(tp, name, None)
        if fn is not None:
            return fn
    raise TpSliceError("this transformers has no tensor-parallel plan matcher; the raw stage cannot split for it")


def _match(fn: Any, name: str, plan: dict[str, str]) -> str | None:
    try:
        return fn(parameter_name=name, plan=plan, is_weight=True)  # type: ignore[no-any-return]
    except TypeError:
        return fn(parameter_name=name, tp_plan=plan, is_weight=True)  # type: ignore[no-any-return]


class _SizeMesh:
    """All ``validate_param`` asks of a mesh is its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def style_dim(style_name: str, module: Any, leaf: str, ndim: int, tensor: str) -> int | None:
    """The dimension ``style_name`` shards ``module.<leaf>`` on, None if replicated."""
    from transformers.distributed import tensor_parallel as tp

    style = _style_obj(style_name)
    if style is None:
        raise TpSliceError(f"tensor {tensor}: the tensor-parallel plan names style {style_name!r}, "
                           "which this transformers does not define")
    embedding = isinstance(module, torch.nn.Embedding)
    kind = type(style)
    if kind is tp.ColwiseParallel:
        dim = 1 if embedding else ndim - 2
    elif kind is tp.RowwiseParallel:
        if embedding:
            dim = 0
        elif leaf == "bias":
            return REPLICATE
        else:
            dim = ndim - 1
    elif kind is getattr(tp, "SequenceParallel", None) or kind.shard_param is tp.TensorParallelLayer.shard_param:
        return REPLICATE
    else:
        raise TpSliceError(
            f"tensor {tensor}: tensor-parallel style {style_name!r} ({kind.__name__}) is not supported at the "
            "raw stage (only column-wise, row-wise and replicated tensors are); serve it with -tp 1"
        )
    if not 0 <= dim < ndim:
        raise TpSliceError(f"tensor {tensor}: style {style_name!r} shards dim {dim} of a {ndim}-d tensor")
    return dim


def plan_slices(
    checkpoint: str | os.PathLike[str],
    tensors: Iterable[tuple[str, Sequence[int]]],
    tp_size: int,
    tp_rank: int = 0,
) -> dict[str, Slice]:
    """Every tensor's split for a ``tp_size``-way transformers engine."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise TpSliceError(f"tensor-parallel rank {tp_rank} of size {tp_size} is not a valid rank")
    items = list(tensors)
    if tp_size == 1:
        return {n: Slice(n, None, REPLICATE) for n, _ in items}
    try:
        model = build_meta_model(checkpoint)
    except ImportError as exc:
        raise TpSliceError(f"splitting for tensor parallelism needs transformers: {exc}") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise TpSliceError(f"cannot build the model from config.json to read its tensor-parallel plan: {exc}") from exc
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise TpSliceError(
            f"{type(model).__name__} has no tensor-parallel plan (transformers' tp_plan is empty); "
            "it cannot be served with -tp > 1 at the raw stage"
        )
    match = _matcher()
    out: dict[str, Slice] = {}
    for name, shape in items:
        style = _match(match, name, plan)
        if style is None:
            out[name] = Slice(name, None, REPLICATE)
            continue
        owner_name, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner_name)
        except AttributeError:
            module = None
        if module is not None:
            style_obj = _style_obj(style)
            if style_obj is not None and leaf in getattr(module, "_parameters", {}):
                try:
                    style_obj.validate_param(module, leaf, _SizeMesh(tp_size), parameter_name=name)
                except ValueError as exc:
                    raise TpSliceError(f"tensor {name}: {exc}") from exc
        out[name] = Slice(name, style, style_dim(style, module, leaf, len(shape), name))
    return out


def _style_obj(style: str) -> Any:
    from transformers.distributed import tensor_parallel as tp

    styles = getattr(tp, "ALL_PARALLEL_STYLES", None)
    if styles is None or style not in styles:
        return None
    return styles[style]


def read_slice(shard: Any, info: Any, target: torch.Tensor, sl: Slice, tp_size: int, rank: int) -> None:
    """Read ``info`` from ``shard`` (every byte hashed, as always) and keep
    only this rank's slice in ``target``; whole tensors go straight in."""
    if sl.dim is None:
        shard.read_into(info, target)
        return
    full = shard.read_tensor(info)
    part = chunk(full, sl.dim, tp_size, rank)
    if tuple(part.shape) != tuple(target.shape):
        raise TpSliceError(f"tensor {info.name}: slice of shape {tuple(part.shape)}, "
                           f"the arena holds {tuple(target.shape)}")
    target.copy_(part)
