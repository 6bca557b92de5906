"""The Triton kernel behind ``preload.checksum`` (the math: :mod:`preload.checksum.scheme`).

Kept in its own module, at module level and without
``from __future__ import annotations``: Triton resolves names through the
kernel function's globals and reads ``tl.constexpr`` annotations as
objects, so a kernel nested in a function or with string annotations is
fragile across Triton releases. Importing this module fails where Triton is
missing; ``preload.checksum`` then uses its torch path.

The checksum's weights repeat every 4096 words (lane A's table) and change
once per 4096-word block (lane B's). A program covers one ``TILE``-word
slice (``sub``) of ``ITERS`` consecutive blocks of one tensor: it loads the
``TILE`` table weights of its slice once and reuses them for every block,
so a small tile keeps few registers per thread (more loads in flight)
without re-reading the table per block. The three lanes sit in per-thread
32-bit accumulators, are reduced once, and are added into ``out[segment]``
with 32-bit atomics (wrap-around addition is exactly the mod 2**32 sum, so
the order programs finish in changes nothing). Full tiles take an unmasked
path; only a tensor's last block masks the words past its end and the bytes
past its end within the last word.
"""

import triton
import triton.language as tl


@triton.jit
def wsum(words, seg_of_prog, seg_prog0, seg_word0, seg_nbytes, ta, tb, out,
         TILE: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(seg_of_prog + pid)
    prog = (pid - tl.load(seg_prog0 + seg)).to(tl.int64)  # program index within the tensor
    group = prog // (4096 // TILE)  # which ITERS blocks
    sub = prog % (4096 // TILE)  # which TILE-word slice of each block
    # Tensors start 256-byte aligned (the caller checks): telling Triton so
    # lets it issue 16-byte vector loads instead of one load per word.
    word0 = tl.multiple_of(tl.load(seg_word0 + seg), 64)
    nbytes = tl.load(seg_nbytes + seg)
    j = tl.arange(0, TILE)
    wa = tl.load(ta + sub * TILE + j).to(tl.uint32, bitcast=True)
    # KB = 0x9E3779B1 as an int32 bit pattern: a literal above 2**31 would promote to int64.
    kb = tl.full((), -1640531535, tl.int32).to(tl.uint32, bitcast=True)
    acc_a = tl.zeros([TILE], dtype=tl.uint32)
    acc_b = tl.zeros([TILE], dtype=tl.uint32)
    acc_c = tl.zeros([TILE], dtype=tl.uint32)
    for it in tl.static_range(ITERS):
        blk = group * ITERS + it  # 4096-word block index within the tensor
        k0 = blk * 4096 + sub * TILE  # first word of this tile within the tensor
        left = nbytes - k0 * 4  # bytes of the tensor from this tile on
        ptr = words + tl.multiple_of(word0 + k0, 64)
        if left >= TILE * 4:
            x = tl.load(ptr + j).to(tl.uint32, bitcast=True)
        else:
            valid = tl.maximum(left, 0).to(tl.int32) - j * 4
            x = tl.load(ptr + j, mask=valid > 0, other=0).to(tl.uint32, bitcast=True)
            shift = (tl.minimum(tl.maximum(valid, 0), 3) * 8).to(tl.uint32)
            x = tl.where(valid >= 4, x, x & ((tl.full([TILE], 1, tl.uint32) << shift) - 1))
        wb = tl.load(tb + (blk & 4095)).to(tl.uint32, bitcast=True)
        wb = (wb + (blk >> 12).to(tl.uint32) * kb) | 1
        acc_a += x * wa
        acc_b += x * wb
        acc_c += ((x << 16) | (x >> 16)) * wa
    tl.atomic_add(out + seg * 3 + 0, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 2, tl.sum(acc_c, axis=0).to(tl.int32, bitcast=True))
