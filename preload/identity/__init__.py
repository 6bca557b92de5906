"""Checkpoint identity: digests, manifests, anchor schemes and the cache key.

The shard set and its headers are :mod:`pgbase.shards` (fixtures read them too).
"""

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
