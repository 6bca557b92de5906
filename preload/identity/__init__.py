"""Checkpoint identity: digests, manifests, anchor schemes and the cache key.

The shard set and its headers are :mod:`pgbase.shards` (fixtures read them too).
The names below are resolved on first use (PEP 562), so a caller that needs
only the cache key (an engine's client) does not import manifests, stat
backends and the anchor schemes with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preload.identity.digest import checkpoint_digest, hash_shards
    from preload.identity.key import WeightCacheKey
    from preload.identity.manifest import (
        Manifest,
        Resolution,
        build_manifest,
        load_manifest,
        resolve_digest,
        write_manifest,
    )

__all__ = [
    "Manifest",
    "Resolution",
    "WeightCacheKey",
    "build_manifest",
    "checkpoint_digest",
    "hash_shards",
    "load_manifest",
    "resolve_digest",
    "write_manifest",
]

_HOMES = {
    "checkpoint_digest": "preload.identity.digest",
    "hash_shards": "preload.identity.digest",
    "WeightCacheKey": "preload.identity.key",
    **{n: "preload.identity.manifest" for n in
       ("Manifest", "Resolution", "build_manifest", "load_manifest", "resolve_digest", "write_manifest")},
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'preload.identity' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
