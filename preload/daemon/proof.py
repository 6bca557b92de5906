"""The byte proof: read each shard once, hash every byte in that same pass.

A daemon's claim "these are the weights of digest D" rests on this module:
each shard is read sequentially (header first, then every tensor in file
order, no gaps), each chunk goes into its destination and into SHA-256 from
the same buffer, and the checkpoint digest built from those per-shard hashes
must equal the digest the daemon was asked to serve. Nothing is trusted from
a previous read, a manifest or a file's stat.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from pgbase import dtypes
from pgbase.errors import CheckpointError, DigestMismatchError
from pgbase.oscause import describe
from pgbase.shards import (
    MAX_HEADER_BYTES,
    ShardHeader,
    TensorInfo,
    library_view,
    parse_accepted,
)
from preload.identity.digest import checkpoint_digest
from preload.identity.manifest import Manifest, promote_command

CHUNK_BYTES = 8 << 20

def torch_dtype(info: TensorInfo, shard: str) -> torch.dtype:
    """The torch dtype ``safe_open(framework="pt")`` loads ``info`` as, from
    the one table of dtypes safetensors and torch share (:mod:`pgbase.dtypes`);
    CheckpointError naming the tensor, the dtype and the versions when torch
    has no type for it."""
    return dtypes.for_tensor(info.name, info.dtype, info.shape, shard).torch


def torch_shape(info: TensorInfo, shard: str) -> tuple[int, ...]:
    """``info.shape`` as the library's torch tensor has it (packed dtypes
    shrink the last dimension: ``F4`` packs two values per
    ``float4_e2m1fn_x2``); CheckpointError when it does not divide."""
    return dtypes.torch_shape(dtypes.for_tensor(info.name, info.dtype, info.shape, shard), info.shape)


class ProvenShard:
    """One shard read for a single hashed pass; read tensors in file order.

    It holds no descriptor between its header and its data: the header is
    read (and checked against the safetensors library) when it is made, the
    file is opened again at the first tensor read and closed by
    :meth:`finish`, so a stage that plans every shard's header before it
    reads any data keeps one shard open at a time, whatever the shard count
    (1,500 shards under ``ulimit -n`` 1024 used to run out). The header read
    again must be byte-identical to the one the tensors were placed by, and
    the file the same one (device, inode, size), or the read is refused.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self._sha = hashlib.sha256()
        self._f: io.FileIO | None = None
        # Validity is the safetensors library's answer; placement follows the
        # header bytes hashed below, which must agree with the library's view.
        library = library_view(self.path, self.name)
        f = self._open()
        try:
            st = os.fstat(f.fileno())
            self.size = st.st_size
            self._identity = (st.st_dev, st.st_ino, st.st_size)
            prefix = _read_exact(f, 8, self.name)
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > self.size:
                raise CheckpointError(f"bad header length {header_len} for a {self.size}-byte file", self.name)
            raw = _read_exact(f, header_len, self.name)
        finally:
            f.close()
        # The header we place tensors by is the header we hashed.
        self.header: ShardHeader = parse_accepted(self.name, str(self.path), self.size, header_len, raw, library)
        self._sha.update(prefix)
        self._sha.update(raw)
        self._header_sha = hashlib.sha256(prefix + raw).digest()
        self._pos = 8 + header_len
        self._staging: torch.Tensor | None = None

    def _open(self) -> io.FileIO:
        try:
            return io.FileIO(self.path, "rb")
        except OSError as exc:
            raise CheckpointError(f"cannot open shard: {describe(exc, self.path)}", self.name) from exc

    def _data(self) -> io.FileIO:
        """The file, opened again for the data pass: the same file, the same header."""
        if self._f is not None:
            return self._f
        f = self._open()
        try:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino, st.st_size) != self._identity:
                raise CheckpointError("was replaced or resized between reading its header and its data; "
                                      "start again once the checkpoint is no longer being written", self.name)
            start = 8 + self.header.header_len
            if hashlib.sha256(_read_exact(f, start, self.name)).digest() != self._header_sha:
                raise CheckpointError("its header changed between planning and reading; start again once the "
                                      "checkpoint is no longer being written", self.name)
        except BaseException:
            f.close()
            raise
        self._f = f
        return f

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return self.header.tensors

    def read_into(self, info: TensorInfo, target: torch.Tensor) -> None:
        """Read ``info``'s bytes into ``target`` (a contiguous tensor of the
        same byte size, any device) and hash them; tensors must come in file order."""
        if info.begin != self._pos:
            raise CheckpointError(f"tensor {info.name!r} read out of file order", self.name)
        flat = target.reshape(-1).view(torch.uint8)
        if flat.numel() != info.nbytes:
            raise CheckpointError(
                f"tensor {info.name!r}: destination holds {flat.numel()} bytes, file has {info.nbytes}",
                self.name,
            )
        if info.nbytes == 0:
            pass  # zero-size dimension: nothing to read (found by tests/unit/test_identity_headers.py)
        elif flat.device.type == "cpu":
            self._fill(flat.numpy().data, info)
        else:
            # Devices cannot be read into; stage through one reused host chunk.
            if self._staging is None:
                self._staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            done = 0
            while done < info.nbytes:
                n = min(CHUNK_BYTES, info.nbytes - done)
                self._fill(self._staging.numpy().data[:n], info)
                flat[done : done + n].copy_(self._staging[:n], non_blocking=False)
                done += n
        self._pos = info.end

    def _fill(self, out: memoryview, info: TensorInfo) -> None:
        f = self._data()
        done = 0
        while done < len(out):
            n = f.readinto(out[done : done + CHUNK_BYTES])
            if not n:
                raise CheckpointError(f"tensor {info.name!r}: file ended early", self.name)
            self._sha.update(out[done : done + n])
            done += n

    def read_tensor(self, info: TensorInfo) -> torch.Tensor:
        """A fresh CPU tensor holding ``info`` (for loaders that copy)."""
        out = torch.empty(torch_shape(info, self.name), dtype=torch_dtype(info, self.name))
        self.read_into(info, out)
        return out

    def finish(self) -> str:
        """Every byte must have been read; returns the shard's SHA-256."""
        try:
            if self._pos != self.size:
                raise CheckpointError(f"only {self._pos} of {self.size} bytes were read", self.name)
            if self._data().read(1):
                raise CheckpointError("shard grew while it was being read", self.name)
        finally:
            self.close()
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _read_exact(f: io.FileIO, n: int, shard: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError(f"file ended early ({len(data)} of {n} bytes read)", shard)
    return data


def check_digest(
    shard_digests: Mapping[str, str],
    expected: str | None,
    manifest: Manifest | None = None,
) -> str:
    """The checkpoint digest of what was read; DigestMismatchError if it is
    not ``expected``, naming the shards whose sha256 differs from the manifest."""
    digest = checkpoint_digest(shard_digests)
    if expected is None or digest == expected:
        return digest
    detail = ""
    if manifest is not None and manifest.digest == expected:
        recorded = {s.name: s.sha256 for s in manifest.shards}
        changed = sorted(n for n, d in shard_digests.items() if recorded.get(n) != d)
        removed = sorted(set(recorded) - set(shard_digests))
        parts = []
        if changed:
            parts.append("shards whose sha256 differs from the manifest: " + ", ".join(changed))
        if removed:
            parts.append("shards missing: " + ", ".join(removed))
        detail = "; ".join(parts)
    raise DigestMismatchError(
        f"refusing to serve: the checkpoint's bytes hash to {digest[:16]}..., not the expected "
        f"{expected[:16]}...{' (' + detail + ')' if detail else ''}; if the new content is intended, "
        f"run: {promote_command(manifest.checkpoint) if manifest is not None else 'preload-gate promote CKPT'}"
    )
