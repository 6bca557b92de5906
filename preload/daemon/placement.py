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

from preload.errors import PreloadGateError


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
