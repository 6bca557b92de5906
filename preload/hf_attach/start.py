"""An engine start over :func:`~preload.hf_attach.attach_model`: :func:`load_rank`.

Exactly one load event per rank (:mod:`preload.events`), and one decision
all ranks share: a miss on any rank fails every rank, or (fallback on)
that rank alone loads from disk.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from pgbase.errors import CacheKeyMismatchError, ProtocolError, WeightCacheUnavailableError
from preload.hf_attach.attach import AttachedModel, attach_model
from preload.hf_attach.disk import disk_model
from preload.hf_attach.model import AttachError, tp_mesh
from preload.hf_attach.ranks import bind_device, process_tp_rank


def _ranks_that_missed(missed: bool, tp_size: int, tp_rank: int, device: torch.device) -> list[int]:
    """Every rank learns which ranks missed (one all-reduce of a flag per rank)."""
    if tp_size == 1:
        return [0] if missed else []
    import torch.distributed as dist

    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = torch.zeros(tp_size, dtype=torch.int32, device=where)
    flags[tp_rank] = int(missed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


MISSES = (WeightCacheUnavailableError, CacheKeyMismatchError, AttachError, ProtocolError)


def load_rank(
    checkpoint: str | os.PathLike[str],
    *,
    fallback: bool = False,
    events_file: str | None = None,
    device: str | torch.device = "cuda",
    tp_size: int = 1,
    **attach: Any,
) -> AttachedModel:
    """:func:`attach_model` as an engine start: exactly one load event per
    rank (``preload.events``), and a decision all ranks share.

    A rank whose daemon is missing or holds another key is a miss naming
    the rank and the key fields. With ``fallback`` off the whole start fails
    on every rank (AttachError), also on ranks that attached; with it on,
    that rank loads its own slices from disk (``source: "disk"`` in its
    event) and the others keep the daemon's weights.
    """
    from preload.events import LoadEvent, emit

    dev = bind_device(device)
    tp_rank = process_tp_rank(tp_size)
    mesh = tp_mesh(dev, tp_size) if tp_size > 1 else None
    t0 = time.perf_counter()
    attached: AttachedModel | None = None
    miss: Exception | None = None
    try:
        attached = attach_model(checkpoint, device=dev, tp_size=tp_size, mesh=mesh, **attach)
    except Exception as exc:  # every rank must reach the all-reduce below, whatever failed
        miss = exc
    missed = _ranks_that_missed(miss is not None, tp_size, tp_rank, dev)
    if miss is not None and not isinstance(miss, MISSES):
        emit(LoadEvent("error", f"rank {tp_rank}: {type(miss).__name__}: {miss}", rank=tp_rank,
                       seconds=time.perf_counter() - t0), events_file)
        raise miss
    mode = str(attach.get("mode", "zero_copy"))
    if attached is not None:
        event = LoadEvent("hit", "attached", digest=attached.digest, daemon_digest=attached.daemon_digest,
                          mode=mode, tensors=attached.tensors, bytes=attached.bytes, rank=tp_rank,
                          source="daemon")
        if missed and not fallback:
            attached.close()
            event.outcome, event.source = "error", "none"
            event.reason = f"ranks {missed} missed and fallback is off: the whole start fails"
            event.seconds = time.perf_counter() - t0
            emit(event, events_file)
            raise AttachError(f"rank {tp_rank}: {event.reason}")
        event.seconds = time.perf_counter() - t0
        emit(event, events_file)
        return attached
    assert miss is not None
    fields = list(getattr(miss, "fields", []) or [])
    reason = str(miss) if str(miss).startswith(f"rank {tp_rank}") else f"rank {tp_rank}: {miss}"
    event = LoadEvent("miss", reason, fields=fields, mode=mode, rank=tp_rank, source="none")
    if not fallback:
        event.seconds = time.perf_counter() - t0
        emit(event, events_file)
        raise AttachError(f"{reason}; fallback is off: the whole start fails") from miss
    model = disk_model(checkpoint, dev, tp_size, tp_rank, mesh)
    event.source = "disk"
    event.reason = reason + "; loaded this rank from disk (fallback)"
    event.tensors = sum(1 for _ in model.parameters())
    event.seconds = time.perf_counter() - t0
    emit(event, events_file)
    return AttachedModel(model=model, digest="", mode=mode, tensors=event.tensors, bytes=0, rank=tp_rank,
                         source="disk")
