"""Synthetic checkpoints for the benchmarks: many shards of random bf16,
any size (large shards are streamed, so size is bounded by disk only)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from fixtures.shardfile import RawTensor, write_shard
from pgbase import atomic
from pgbase.shards import INDEX_NAME


def write_synthetic(
    out: Path, shards: int, shard_bytes: int, tensors_per_shard: int = 4, seed: int = 0
) -> list[Path]:
    """A checkpoint of ``shards`` files of about ``shard_bytes`` random bf16 each,
    with an index and a config; written in chunks, so size is bounded by disk only.

    Raises BenchError, before a byte is written, when the shards do not fit
    in the free space of ``out``'s filesystem (statvfs ``f_bavail``)."""
    check_room(out, shards * shard_bytes)
    out.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(seed)
    per_tensor = max(2, (shard_bytes // tensors_per_shard) // 2 * 2)
    weight_map: dict[str, str] = {}
    paths = []
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        names = [f"model.layers.{k}.w{j}.weight" for j in range(tensors_per_shard)]
        if per_tensor <= (64 << 20):
            tensors = {
                n: RawTensor("BF16", (per_tensor // 2,), rng.bytes(per_tensor)) for n in names
            }
            write_shard(out / name, tensors)
        else:
            # Large shards: write the header, then stream the data.
            _stream_shard(out / name, names, per_tensor, rng)
        weight_map.update({n: name for n in names})
        paths.append(out / name)
    atomic.write_json(out / INDEX_NAME, {"metadata": {}, "weight_map": weight_map})
    atomic.write_json(out / "config.json", {"architectures": ["SyntheticForBench"]})
    return paths


def check_room(out: Path, need: int) -> None:
    """BenchError unless ``need`` bytes fit in what an unprivileged writer may
    use of the filesystem ``out`` is (or would be) made on."""
    from harness.bench.errors import BenchError
    from pgbase.limits import gib

    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise BenchError(f"a synthetic checkpoint of {gib(need)} does not fit in {out}: {gib(free)} free on its "
                         "filesystem; lower --size or the row's shards/shard_mb, or give --workdir a larger disk")


def _stream_shard(path: Path, names: list[str], per_tensor: int, rng: np.random.Generator) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in names:
        header[n] = {"dtype": "BF16", "shape": [per_tensor // 2], "data_offsets": [offset, offset + per_tensor]}
        offset += per_tensor
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _ in names:
            left = per_tensor
            while left:
                chunk = min(left, 64 << 20)
                f.write(rng.bytes(chunk))
                left -= chunk
    os.replace(tmp, path)
