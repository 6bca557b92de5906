"""Which ranks a node's daemons serve: the same rule vLLM's engine uses.

Global ranks enumerate DP, then PP, then TP::

    global = dp_rank * pp_size * tp_size + pp_rank * tp_size + tp_rank

With ``--nnodes`` each node serves a contiguous block of ``world / nnodes``
global ranks starting at ``node_rank * world / nnodes``; without it a
launcher serves ``data_parallel_size_local`` DP ranks starting at
``data_parallel_start_rank``. (Reimplemented from vLLM's
``plan_local_ranks``; a table test pins it.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pgbase.errors import PreloadGateError


class PlacementError(PreloadGateError):
    """The parallel sizes cannot be mapped onto this node's daemons."""


@dataclass(frozen=True)
class Parallelism:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    dp_size_local: int | None = None
    dp_start_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.tp_size


@dataclass(frozen=True)
class Placement:
    local_rank: int
    global_rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def plan_local_ranks(p: Parallelism) -> list[Placement]:
    """The daemons this node runs, one per local rank.

    >>> [x.global_rank for x in plan_local_ranks(Parallelism(tp_size=4, nnodes=2, node_rank=1))]
    [2, 3]
    """
    for name in ("tp_size", "pp_size", "dp_size", "nnodes"):
        if getattr(p, name) < 1:
            raise PlacementError(f"{name} must be at least 1, got {getattr(p, name)}")
    if not 0 <= p.node_rank < p.nnodes:
        raise PlacementError(f"node rank {p.node_rank} is outside 0..{p.nnodes - 1}")
    stage = p.pp_size * p.tp_size
    if p.nnodes > 1:
        if p.world_size % p.nnodes:
            raise PlacementError(
                f"--nnodes ({p.nnodes}) must evenly divide the world size ({p.world_size} = "
                f"data-parallel {p.dp_size} x pipeline-parallel {p.pp_size} x tensor-parallel {p.tp_size})"
            )
        local_world = p.world_size // p.nnodes
        base = p.node_rank * local_world
    else:
        dp_local = p.dp_size if p.dp_size_local is None else p.dp_size_local
        if p.dp_start_rank + dp_local > p.dp_size:
            raise PlacementError(
                f"data-parallel start rank + local size ({p.dp_start_rank + dp_local}) exceeds "
                f"data-parallel size ({p.dp_size})"
            )
        local_world = dp_local * stage
        base = p.dp_start_rank * stage
    out = []
    for local_rank in range(local_world):
        g = base + local_rank
        dp_rank, rank_in_dp = divmod(g, stage)
        pp_rank, tp_rank = divmod(rank_in_dp, p.tp_size)
        out.append(Placement(local_rank, g, dp_rank, pp_rank, tp_rank))
    return out


# --- which daemon an engine process attaches: found by GPU UUID, never by index ---


def visible_uuids(cuda_visible_devices: str | None, physical: list[str]) -> list[str]:
    """The GPUs a process sees, in its own index order, given
    ``CUDA_VISIBLE_DEVICES`` and the host's GPUs (UUIDs in physical order).

    Entries are indices or (prefixes of) UUIDs, as CUDA reads them; CUDA
    stops at the first entry it cannot resolve. Used to reason about (and
    test) renumbered devices; a live process asks torch for its UUIDs.

    >>> visible_uuids("1,0", ["GPU-a", "GPU-b"])
    ['GPU-b', 'GPU-a']
    """
    if cuda_visible_devices is None:
        return list(physical)
    out: list[str] = []
    for raw in cuda_visible_devices.split(","):
        item = raw.strip()
        if item.isdigit():
            idx = int(item)
            if idx >= len(physical):
                break
            found = physical[idx]
        else:
            want = item if item.startswith("GPU-") else f"GPU-{item}"
            hits = [u for u in physical if u.startswith(want)] if item else []
            if len(hits) != 1:
                break
            found = hits[0]
        if found in out:
            break
        out.append(found)
    return out


def rank_on_gpu(
    daemon_uuids: dict[int, str | None], own_uuid: str, tp_size: int = 1, tp_rank: int = 0
) -> int | None:
    """The global rank of the daemon that holds this engine rank's weights on
    the engine's own GPU: same physical GPU (UUID) and same TP rank
    (``global % tp_size``); None if no daemon lives on that GPU.

    ``daemon_uuids`` maps each serving global rank to the UUID of its GPU
    (None for a daemon not on a GPU). Two daemons of the same TP rank on one
    GPU are ambiguous and refused.

    >>> rank_on_gpu({0: "GPU-a", 1: "GPU-b"}, "GPU-b")
    1
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise PlacementError(f"tensor-parallel rank {tp_rank} of size {tp_size} is not a valid rank")
    hits = sorted(g for g, u in daemon_uuids.items() if u == own_uuid and g % tp_size == tp_rank)
    if len(hits) > 1:
        raise PlacementError(
            f"daemons of global ranks {hits} all serve tensor-parallel rank {tp_rank} on {own_uuid}; "
            "stop all but one"
        )
    return hits[0] if hits else None
