"""The resident checksum's definition: three weighted 32-bit lanes.

The checksum of a tensor, over its bytes read as little-endian 32-bit
words ``x[k]`` (the last word zero-padded), is three 32-bit lanes, all
mod 2**32:

- ``A = sum x[k] * TA[k % 4096]``
- ``B = sum x[k] * WB(k // 4096)`` with ``WB(b) = (TB[b % 4096] + (b >> 12) * KB) | 1``
- ``C = sum rot16(x[k]) * TA[k % 4096]``

with fixed pseudo-random odd tables. C reuses A's table: the rotation
already makes it a different function of the words, and one table less
keeps the kernel's registers (and so its memory parallelism) up. Why this shape:

- every weight is odd, hence invertible mod 2**32: changing any one word
  (one flipped element) changes A, always, not just probably;
- weights depend on the position, so two swapped elements change the sum
  (a plain sum is blind to that; the unit tests show it); A covers swaps
  at distances that are not multiples of 4096 words, B those that are;
- C sees the word with its halves exchanged, so a change confined to the
  high 16 bits (a bf16 element in the upper half) is as visible as one in
  the low bits: ``d * w`` vanishes mod 2**32 only if the powers of two in
  ``d`` and ``w`` add up to 32;
- B's weight is constant over a 4096-word block, so on the GPU it costs
  one add per word, and A and C one multiply-add each: the kernel stays
  memory-bound.

The index ``k`` counts from each tensor's start, so a checksum belongs to
the tensor's bytes, not to where the arena placed them.

The torch path (:mod:`preload.checksum.reference`) and the Triton kernel
(:mod:`preload.checksum.kernel`) both compute exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SCHEME = "wsum32x3-v1"
BLOCK_WORDS = 4096
TABLE = 4096
KB = 0x9E3779B1
MASK = 0xFFFFFFFF


def _splitmix32(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic pseudo-random odd uint32 values (no RNG library state)."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    x &= np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return ((x & np.uint64(MASK)) | np.uint64(1)).astype(np.uint32)


TA = _splitmix32(0xA11CE, TABLE)
TB = _splitmix32(0xB0B, TABLE)
_Tables = tuple[torch.Tensor, torch.Tensor]
_tables: dict[tuple[torch.device, torch.dtype], _Tables] = {}


def device_tables(device: torch.device, dtype: torch.dtype) -> _Tables:
    """The weight tables as int64 (torch path) or int32 bit patterns (kernel)."""
    key = (torch.device(device), dtype)
    if key not in _tables:
        if dtype == torch.int32:
            conv = [torch.from_numpy(t.view(np.int32).copy()) for t in (TA, TB)]
        else:
            conv = [torch.from_numpy(t.astype(np.int64)) for t in (TA, TB)]
        ta, tb = (t.to(key[0]) for t in conv)
        _tables[key] = (ta, tb)
    return _tables[key]


@dataclass(frozen=True)
class Checksum:
    """Three 32-bit lanes; on the wire as 24 hex digits."""

    a: int
    b: int
    c: int

    def hex(self) -> str:
        return f"{self.a:08x}{self.b:08x}{self.c:08x}"

    @classmethod
    def from_lanes(cls, lanes: Any) -> Checksum:
        a, b, c = (int(v) & MASK for v in lanes)
        return cls(a, b, c)
