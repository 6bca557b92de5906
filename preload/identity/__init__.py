"""Checkpoint identity: shard sets, digests, manifests and the cache key."""

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
from preload.identity.shards import read_header, shard_paths

__all__ = [
    "Manifest",
    "Resolution",
    "WeightCacheKey",
    "build_manifest",
    "checkpoint_digest",
    "hash_shards",
    "load_manifest",
    "read_header",
    "resolve_digest",
    "shard_paths",
    "write_manifest",
]
