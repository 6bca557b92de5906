"""Gate targets: the weight caches the gate can judge, one module each.

>>> get_target("npcache").checkpoint_format
'bin'
"""

from __future__ import annotations

from harness.targets.base import CacheTarget
from harness.targets.header_only import HeaderOnlyTarget
from harness.targets.ipc_cache import IpcCacheTarget
from harness.targets.loaders import FastsafetensorsTarget, InstanttensorTarget, RunaiStreamerTarget
from harness.targets.npcache import NpcacheTarget
from harness.targets.sharded_state import ShardedStateTarget
from harness.targets.tensorizer import TensorizerTarget
from harness.targets.verified_cache import VerifiedCacheTarget
from pgbase.errors import PreloadGateError

TARGETS: dict[str, type[CacheTarget]] = {
    t.name: t for t in (VerifiedCacheTarget, HeaderOnlyTarget, NpcacheTarget, ShardedStateTarget, IpcCacheTarget,
                        FastsafetensorsTarget, InstanttensorTarget, RunaiStreamerTarget, TensorizerTarget)
}
NAMES = tuple(TARGETS)
# `--target all`: the gate once per target, in this order.
ALL = "all"


class UnknownTargetError(PreloadGateError):
    """--target named a cache the gate does not know."""


def get_target(name: str) -> CacheTarget:
    if name not in TARGETS:
        raise UnknownTargetError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]()


__all__ = ["ALL", "NAMES", "TARGETS", "CacheTarget", "UnknownTargetError", "get_target"]
