"""Which daemon rank serves this process, and the connection to it.

On CUDA the daemon is found on this process's own GPU by UUID; a rank that
finds none is a :class:`RankMissError` naming the rank and, when a sibling
daemon of the same digest answers, the key fields that differ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pgbase.errors import (
    CacheKeyMismatchError,
    DaemonBusyError,
    ProtocolError,
    WeightCacheUnavailableError,
)
from preload.client import DaemonClient


class RankMissError(WeightCacheUnavailableError):
    """This engine rank found no daemon serving it: names the rank and the key fields."""

    def __init__(self, rank: int, fields: list[str], detail: str) -> None:
        self.rank = rank
        self.fields = list(fields)
        super().__init__(f"rank {rank}: {detail}" + (f" (fields: {', '.join(self.fields)})" if self.fields else ""))


def daemon_gpus(sdir: str | os.PathLike[str]) -> dict[int, str | None]:
    """Each serving rank in ``sdir`` and the GPU (UUID) its arena lives on,
    from the daemons' own hello; ranks that do not answer are left out
    (busy ones too: :func:`probe_gpus` tells them apart)."""
    return probe_gpus(sdir)[0]


def probe_gpus(sdir: str | os.PathLike[str]) -> tuple[dict[int, str | None], dict[int, DaemonBusyError]]:
    """``(gpus, busy)``: :func:`daemon_gpus`'s map, and each rank whose
    daemon listens but stayed too busy to answer (its listen backlog full
    for the connect timeout), with the error that says so."""
    out: dict[int, str | None] = {}
    busy: dict[int, DaemonBusyError] = {}
    for rank in socket_ranks(Path(sdir)):
        try:
            c = DaemonClient.connect(sdir, rank, client="preload-gate-hf-probe")
        except DaemonBusyError as exc:
            busy[rank] = exc
            continue
        except (WeightCacheUnavailableError, ProtocolError):
            continue
        try:
            uuid = c.hello.get("gpu_uuid")
            out[rank] = uuid if isinstance(uuid, str) else None
        finally:
            c.close()
    return out, busy


def socket_ranks(sdir: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("rank")) for p in sdir.glob("rank*.sock")
                  if p.stem.removeprefix("rank").isdigit())


def find_rank(sdir: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0) -> int:
    """The global rank whose daemon holds this engine rank's weights.

    On CUDA: the daemon on this process's own physical GPU, matched by UUID
    (``CUDA_VISIBLE_DEVICES`` renumbers indices per process, so an index
    says nothing about which GPU it is). On CPU: the TP rank (first DP replica).
    """
    from preload.daemon.placement import rank_on_gpu

    if device.type != "cuda":
        return tp_rank
    from preload.transports.cuda import device_uuid

    index = device.index if device.index is not None else torch.cuda.current_device()
    own = device_uuid(index)
    gpus, busy = probe_gpus(sdir)
    g = rank_on_gpu(gpus, own, tp_size, tp_rank)
    if g is None and busy:
        # Which GPU a busy daemon is on is unknown: it may be this engine's. Say
        # busy (the loader's daemon_busy miss), not "no daemon on this GPU".
        first = min(busy)
        raise DaemonBusyError(f"no answering daemon in {sdir} serves tensor-parallel rank {tp_rank} on this "
                              f"engine's GPU cuda:{index} ({own}), and rank(s) "
                              f"{', '.join(str(r) for r in sorted(busy))} are busy: {busy[first]}")
    if g is None:
        seen = ", ".join(f"rank{r}={u}" for r, u in sorted(gpus.items())) or "none answering"
        raise RankMissError(tp_rank, ["gpu_uuid"], f"no daemon in {sdir} serves tensor-parallel rank {tp_rank} "
                            f"on this engine's GPU cuda:{index} ({own}); daemons: {seen}; start "
                            "preload-gate preload on this GPU, or run this rank on its daemon's GPU")
    return g


def connect_rank(sdir: Path, global_rank: int, tp_rank: int, key: Any) -> DaemonClient:
    """Connect to ``global_rank``'s daemon; a missing rank is a RankMissError
    naming the key fields a sibling daemon of the same digest differs on."""
    try:
        return DaemonClient.connect(sdir, global_rank, client="preload-gate-hf")
    except DaemonBusyError as exc:  # alive and busy: no sibling's key says anything about it
        raise RankMissError(tp_rank, [], str(exc)) from exc
    except WeightCacheUnavailableError as exc:
        others = [r for r in socket_ranks(sdir) if r != global_rank]
        fields: list[str] = []
        for r in others[:1]:
            try:
                c = DaemonClient.connect(sdir, r, client="preload-gate-hf-probe")
            except (WeightCacheUnavailableError, ProtocolError):
                break
            try:
                c.get_state(key).close()
            except CacheKeyMismatchError as mis:
                fields = mis.fields
            except (WeightCacheUnavailableError, ProtocolError):
                pass
            finally:
                c.close()
        where = f"daemons of this digest serve ranks {others}" if others else "no daemon serves this digest"
        raise RankMissError(tp_rank, fields, f"no daemon for global rank {global_rank} in {sdir}: {where}") from exc


def bind_device(device: str | torch.device) -> torch.device:
    """The device with its index made explicit; a CUDA device becomes current."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def process_tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"tp_size={tp_size} needs torch.distributed initialised (torchrun, one process per rank)")
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tp_size={tp_size}, but the process group has {dist.get_world_size()} ranks")
    return int(dist.get_rank())
