"""The shard set of a checkpoint and each shard's header, by their owners' rules.

The shard set is the one vLLM's loader reads (:mod:`pgbase.fileset`:
vLLM's own ``_prepare_weights`` when it imports, a mirror proven equal when
not). A header is valid exactly when the safetensors library opens the file;
its names, dtypes and shapes are the library's, and our offsets must agree
(``tests/unit/test_identity_headers.py`` holds that by a differential test).

Headers are checked before any weight byte is trusted: a header that lies
about its tensors would otherwise hash fine and fail later, deep inside an
engine, with a message nobody can act on.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pgbase.errors import CheckpointError
from pgbase.fileset import select_files, servable
from pgbase.oscause import describe, explain
from pgbase.outdir import nearest_existing

INDEX_NAME = "model.safetensors.index.json"
# safetensors itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000


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


def not_a_directory(checkpoint: str | os.PathLike[str]) -> str:
    """Why ``checkpoint`` is no checkpoint directory, in one line: missing, or
    something else (a file) at that path."""
    hint = "give the folder that holds config.json and the shards"
    if os.path.lexists(checkpoint):
        return f"checkpoint {checkpoint} is not a directory; {hint}"
    up = nearest_existing(Path(checkpoint).parent)
    if not up.is_dir():
        return f"checkpoint {checkpoint} cannot exist: {up} is not a directory; {hint}"
    return f"checkpoint directory {checkpoint} does not exist"


def shard_paths(checkpoint: str | os.PathLike[str], prefer_vllm: bool = True) -> list[Path]:
    """The weight shards vLLM's ``auto`` loader reads, sorted by the byte order of their names.

    The selection is vLLM's own when vLLM imports (``prefer_vllm``), else the
    mirror proven equal to it (:mod:`pgbase.fileset`); a set the
    cache cannot serve exactly (``.bin`` weights) is a CheckpointError.

    >>> shard_paths("/models/smollm2")  # doctest: +SKIP
    [PosixPath('/models/smollm2/model.safetensors')]
    """
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(not_a_directory(ckpt))
    return servable(select_files(ckpt, prefer_vllm=prefer_vllm)).paths


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Read one shard's header, valid exactly when the safetensors library says so.

    Raises CheckpointError naming the shard and the library's reason when
    ``safetensors.safe_open`` refuses the file (truncated, bad JSON, a
    ``__metadata__`` value that is not a string, offsets that overlap, leave
    holes or run past the end...). Offsets come from our reading of the same
    bytes and must agree with the library's names, dtypes and shapes.
    """
    p = Path(path)
    name = p.name
    library = library_view(p, name)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_len,) = struct.unpack("<Q", f.read(8))
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"cannot read shard: {describe(exc, p)}", name) from exc
    except struct.error as exc:
        raise CheckpointError(f"cannot read shard: {exc}", name) from exc
    return parse_accepted(name, str(p), size, header_len, raw, library)


@dataclass(frozen=True)
class LibraryView:
    """What ``safetensors.safe_open`` reports for a file it accepted."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    metadata: dict[str, str]


def library_view(path: str | os.PathLike[str], name: str) -> LibraryView:
    """Open ``path`` with the safetensors library (the owner of the format's
    rules); its refusal is a CheckpointError carrying the library's reason."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            tensors = {}
            for k in f.keys():
                sl = f.get_slice(k)
                tensors[k] = (str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
            metadata = dict(f.metadata() or {})
    except Exception as exc:  # SafetensorError and friends: the library's verdict, unless the OS said no
        cause = explain(exc, path)
        if isinstance(exc, (OSError, MemoryError)) or cause.errno is not None:
            # safetensors words EMFILE and EACCES as "No such file", a failed mmap as MemoryError.
            raise CheckpointError(f"cannot read shard: {cause.text}", name) from exc
        import safetensors

        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(
            f"not a valid safetensors file (safetensors {safetensors.__version__}: {msg})", name
        ) from exc
    return LibraryView(tensors, metadata)


def parse_accepted(name: str, path: str, size: int, header_len: int, raw: bytes,
                   library: LibraryView) -> ShardHeader:
    """Tensor offsets from ``raw`` (the header bytes of a file the library
    accepted), checked against the library's own view of the same file."""
    try:
        header = json.loads(raw.decode("utf-8"))
        header.pop("__metadata__", None)
        ours = {k: (str(v["dtype"]), tuple(int(d) for d in v["shape"]), int(v["data_offsets"][0]),
                    int(v["data_offsets"][1])) for k, v in header.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"header changed after the safetensors library read it ({exc})", name) from exc
    if {k: v[:2] for k, v in ours.items()} != library.tensors:
        raise CheckpointError(
            "our reading of the header disagrees with the safetensors library's (names, dtypes or "
            "shapes); report this with the file's header", name,
        )
    data_start = 8 + header_len
    tensors = sorted(
        (TensorInfo(k, dt, shape, data_start + b, data_start + e) for k, (dt, shape, b, e) in ours.items()),
        key=lambda t: (t.begin, t.end),
    )
    cursor = data_start
    for t in tensors:
        if t.begin != cursor or t.end < t.begin:
            raise CheckpointError(f"tensor {t.name!r}: offsets disagree with the safetensors library's", name)
        cursor = t.end
    if cursor != size:
        raise CheckpointError("the file's size disagrees with the safetensors library's reading", name)
    return ShardHeader(name, path, size, header_len, tuple(tensors), dict(library.metadata))


def duplicate_message(tensor: str, first: str, second: str) -> str:
    return (
        f"tensor {tensor!r} is stored in both {first} and {second}: vLLM loads both and the copy it "
        "keeps depends on directory listing order, so preload-gate refuses the checkpoint; keep the "
        "tensor in one file"
    )


def check_unique_tensors(headers: Iterable[ShardHeader]) -> None:
    """CheckpointError naming the tensor and both files if a name is in two shards."""
    seen: dict[str, str] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise CheckpointError(duplicate_message(t.name, seen[t.name], h.name))
            seen[t.name] = h.name
