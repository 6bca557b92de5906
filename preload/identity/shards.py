"""The shard set of a checkpoint and a strict check of each safetensors header.

The shard set is what vLLM's loader reads: every ``*.safetensors`` file in the
directory, filtered through ``model.safetensors.index.json`` when one exists
(files the index does not name are ignored, files it names must exist).

Headers are checked before any weight byte is trusted: a header that lies
about its tensors would otherwise hash fine and fail later, deep inside an
engine, with a message nobody can act on.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from preload.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
# safetensors itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000

# Bits per element; F4/F6 are packed sub-byte formats.
_DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16,
    "I64": 64, "I32": 32, "I16": 16, "I8": 8,
    "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a shard; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """A validated safetensors header."""

    name: str
    path: str
    size: int
    header_len: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def shard_paths(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """The weight shards vLLM would read, sorted by the byte order of their names.

    >>> shard_paths("/models/smollm2")  # doctest: +SKIP
    [PosixPath('/models/smollm2/model.safetensors')]
    """
    ckpt = Path(checkpoint)
    if not ckpt.exists():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} is not a directory")
    try:
        entries = [e for e in os.scandir(ckpt) if e.name.endswith(".safetensors")]
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint {ckpt}: {exc.strerror or exc}") from exc
    # vLLM globs *.safetensors and would try to load a directory so named;
    # skipping it here would hash a different set than the engine reads.
    for e in entries:
        if not e.is_file():
            raise CheckpointError("is not a regular file (a directory or a special file?)", e.name)
    names = sorted((e.name for e in entries), key=lambda n: n.encode())
    index = ckpt / INDEX_NAME
    if index.is_file():
        wanted = _index_files(index)
        missing = sorted(wanted - set(names))
        if missing:
            raise CheckpointError(
                f"{INDEX_NAME} names shards that do not exist: {', '.join(missing)}"
            )
        names = [n for n in names if n in wanted]
    if not names:
        raise CheckpointError(f"no *.safetensors shards in {ckpt}")
    return [ckpt / n for n in names]


def _index_files(index: Path) -> set[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"unreadable {INDEX_NAME}: {exc}") from exc
    if not all(isinstance(f, str) and "/" not in f for f in files):
        raise CheckpointError(f"{INDEX_NAME} weight_map must map to plain file names")
    return files


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Read and validate one shard's header (one open, two reads).

    Raises CheckpointError naming the shard and the problem: a truncated
    header, a length beyond the file, bad JSON, an unknown dtype, a shape
    that does not fill its byte range, offsets that overlap, leave holes or
    run past the end of the file.
    """
    p = Path(path)
    name = p.name
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"truncated header: file is {size} bytes, a safetensors file needs at least 8",
                    name,
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit", name
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"header length {header_len} runs past the end of the file ({size} bytes)",
                    name,
                )
            raw = f.read(header_len)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read shard: {exc.strerror or exc}", name) from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"header is not UTF-8 (byte {exc.start})", name) from exc
    except ValueError as exc:
        raise CheckpointError(f"header is not JSON: {exc}", name) from exc
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", name)
    return _validate(name, str(p), size, header_len, header)


def _validate(name: str, path: str, size: int, header_len: int, header: dict) -> ShardHeader:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("__metadata__ is not an object", name)
    data_start = 8 + header_len
    data_len = size - data_start
    tensors: list[TensorInfo] = []
    for tname, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(f"tensor {tname!r}: entry is not an object", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BITS:
            raise CheckpointError(f"tensor {tname!r}: unknown dtype {dtype!r}", name)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"tensor {tname!r}: bad shape {shape!r}", name)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(f"tensor {tname!r}: bad data_offsets {offsets!r}", name)
        begin, end = offsets
        if begin < 0 or end < begin:
            raise CheckpointError(f"tensor {tname!r}: bad data_offsets {offsets!r}", name)
        if end > data_len:
            raise CheckpointError(
                f"tensor {tname!r}: data_offsets {offsets} run past the end of the file "
                f"(data region is {data_len} bytes)",
                name,
            )
        expected = math.ceil(math.prod(shape) * _DTYPE_BITS[dtype] / 8)
        if end - begin != expected:
            raise CheckpointError(
                f"tensor {tname!r}: {dtype}{shape} needs {expected} bytes, "
                f"data_offsets give {end - begin}",
                name,
            )
        tensors.append(TensorInfo(tname, dtype, tuple(shape), data_start + begin, data_start + end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    cursor = data_start
    for t in tensors:
        if t.begin < cursor:
            raise CheckpointError(f"tensor {t.name!r}: data_offsets overlap the previous tensor", name)
        if t.begin > cursor:
            raise CheckpointError(f"tensor {t.name!r}: a gap of {t.begin - cursor} bytes precedes it", name)
        cursor = t.end
    if cursor != size:
        raise CheckpointError(
            f"{size - cursor} bytes after the last tensor are not described by the header", name
        )
    return ShardHeader(name, path, size, header_len, tuple(tensors), dict(metadata))
