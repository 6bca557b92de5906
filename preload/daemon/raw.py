"""The ``raw`` stage: a checkpoint's tensors under their checkpoint names.

No vLLM: each shard is read once, every byte hashed in that pass, tensors
placed straight into the arena's views (no second copy of the weights).
Consumers (a transformers model on the meta device, the GPU machine where
vLLM is absent) name tensors as the checkpoint does.
"""

from __future__ import annotations

import os
import time

from pgbase.shards import check_unique_tensors, shard_paths
from preload.budget import check_memory, rank_open_files, reserve_open_files
from preload.checksum import resident_checksums
from preload.daemon.proof import ProvenShard, check_digest, torch_dtype, torch_shape
from preload.daemon.server import MAX_CONNECTIONS
from preload.daemon.stage import Filled, create_arena
from preload.daemon.tp_slice import plan_slices, read_slice
from preload.identity.config import canonical_digest, first_architecture, read_config
from preload.identity.key import WeightCacheKey
from preload.identity.manifest import Manifest
from preload.transports.base import Layout, Transport


def raw_key(
    checkpoint: str | os.PathLike[str], digest: str, transport: str, tp_size: int = 1, tp_rank: int = 0
) -> WeightCacheKey:
    """The key of a raw-stage rank; a raw consumer builds the same one.
    With ``tp_size > 1`` the rank holds only its slices (preload.daemon.tp_slice)."""
    cfg = read_config(checkpoint)  # CheckpointError for a config vLLM could not read either
    return WeightCacheKey(
        content_digest=digest,
        config_digest=None if cfg is None else canonical_digest(cfg),
        architecture=first_architecture(cfg),
        export_stage="raw",
        transport=transport,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def fill_raw(
    checkpoint: str | os.PathLike[str],
    transport: Transport,
    expected_digest: str | None,
    manifest: Manifest | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> Filled:
    """Read, hash and place every tensor; DigestMismatchError (and nothing
    kept) when the bytes do not hash to ``expected_digest``."""
    start = time.perf_counter()
    shards: list[ProvenShard] = []
    # No vLLM here: the mirror of its file selection, proven equal by
    # tests/cpu/test_fileset_differential.py.
    paths = shard_paths(checkpoint, prefer_vllm=False)
    # Before the first shard is opened: one shard open at a time (ProvenShard
    # holds none between header and data), the arena, serving (preload.budget).
    need, want = rank_open_files(MAX_CONNECTIONS, "raw")
    reserve_open_files(need, f"the raw stage ({len(paths)} shards, read one at a time)", want)
    try:
        for path in paths:
            shards.append(ProvenShard(path))
        check_unique_tensors(sh.header for sh in shards)
        specs = [(t.name, torch_dtype(t, sh.name), torch_shape(t, sh.name), "param")
                 for sh in shards for t in sh.tensors]
        slices = plan_slices(checkpoint, [(n, shape) for n, _, shape, _ in specs], tp_size, tp_rank)
        specs = [(n, d, slices[n].local_shape(shape, tp_size, tp_rank), k) for n, d, shape, k in specs]
        layout = Layout.plan(specs)
        # The headers are read, no tensor yet: refuse here an arena that cannot fit.
        check_memory([(f"the raw stage's arena ({len(shards)} shards, {len(specs)} tensors)", layout.total_bytes)],
                     device=transport.memory_device())
        arena = create_arena(transport, layout)
    except BaseException:
        for sh in shards:
            sh.close()
        raise
    try:
        views = arena.views()
        digests = {}
        for sh in shards:
            for t in sh.tensors:
                read_slice(sh, t, views[t.name], slices[t.name], tp_size, tp_rank)
            digests[sh.name] = sh.finish()
        checksums = resident_checksums(arena, views)
        del views
        digest = check_digest(digests, expected_digest, manifest)
        arena.seal()
    except BaseException:
        for sh in shards:
            sh.close()
        arena.close()
        raise
    return Filled(
        arena=arena,
        layout=layout,
        key=raw_key(checkpoint, digest, transport.name, tp_size, tp_rank),
        digest=digest,
        stage="raw",
        shard_digests=digests,
        checksums=checksums,
        load_seconds=time.perf_counter() - start,
        bytes_read=sum(sh.size for sh in shards),
    )
