"""Checkpoint identity: digests, manifests, anchor schemes and the cache key.

One module per concern, imported by name (this package imports nothing, so a
caller that needs only the cache key, an engine's client, does not import
manifests, stat backends and the anchor schemes with it):

- ``preload.identity.digest``: ``checkpoint_digest``, ``hash_shards``;
- ``preload.identity.key``: ``WeightCacheKey``;
- ``preload.identity.manifest``: ``Manifest``, ``build_manifest``,
  ``load_manifest``, ``write_manifest``, ``resolve_digest``, ``Resolution``;
- ``preload.identity.anchors``: the anchor schemes and ``fingerprints``;
- ``preload.identity.filestat``, ``stat_pool``, ``uring``: the restart check's stats.

The shard set and its headers are :mod:`pgbase.shards` (fixtures read them too).
"""
