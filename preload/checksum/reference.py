"""The torch checksum: the reference, and what runs on CPU and in CI.

Tensor by tensor, on any device, chunked so temporaries stay bounded; the
Triton path (:mod:`preload.checksum.planner`) must give the same lanes.
"""

from __future__ import annotations

import torch

from preload.checksum.scheme import KB, MASK, TABLE, Checksum, device_tables

_FALLBACK_CHUNK_WORDS = 1 << 24


def _words(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """uint8 bytes -> int64 tensor of little-endian 32-bit words (zero-padded)."""
    nbytes = flat.numel()
    if flat.storage_offset() % 4:
        flat = flat.clone()  # a 32-bit view needs 4-byte alignment
    pad = -nbytes % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).to(torch.int64) & MASK
    return words, nbytes


def _lanes_torch(flat: torch.Tensor) -> Checksum:
    """The reference computation, chunked so temporaries stay bounded."""
    ta, tb = device_tables(flat.device, torch.int64)
    nwords = -(-flat.numel() // 4)
    a = b = c = torch.zeros((), dtype=torch.int64, device=flat.device)
    for k0 in range(0, nwords, _FALLBACK_CHUNK_WORDS):
        k1 = min(nwords, k0 + _FALLBACK_CHUNK_WORDS)
        x, _ = _words(flat[k0 * 4 : min(k1 * 4, flat.numel())])
        k = torch.arange(k0, k1, dtype=torch.int64, device=flat.device)
        idx = k & (TABLE - 1)
        blk = k >> 12
        wb = ((tb[blk & (TABLE - 1)] + (blk >> 12) * KB) & MASK) | 1
        rot = ((x << 16) | (x >> 16)) & MASK
        # int64 products wrap mod 2**64 (two's complement), which keeps them right mod 2**32.
        a = a + ((x * ta[idx]) & MASK).sum()
        b = b + ((x * wb) & MASK).sum()
        c = c + ((rot * ta[idx]) & MASK).sum()
    return Checksum.from_lanes(torch.stack([a, b, c]).cpu().tolist())


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The checksum of one contiguous tensor's bytes, any device.

    >>> tensor_checksum(torch.zeros(4, dtype=torch.bfloat16))
    '000000000000000000000000'
    """
    if not tensor.is_contiguous():
        raise ValueError("checksums are defined over a contiguous tensor's bytes")
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)
    return _lanes_torch(flat).hex()
