"""The Triton kernel behind ``preload.checksum`` (the math: :mod:`preload.checksum.scheme`).

Kept in its own module, at module level and without
``from __future__ import annotations``: Triton resolves names through the
kernel function's globals and reads ``tl.constexpr`` annotations as
objects, so a kernel nested in a function or with string annotations is
fragile across Triton releases. Importing this module fails where Triton is
missing; ``preload.checksum`` then uses its torch path.

The checksum's weights repeat every 4096 words (lane A's table) and change
once per 4096-word block (lane B's). A program covers one ``TILE``-word
slice (``sub``) of ``ITERS`` consecutive blocks of one tensor, loaded as one
``[ITERS, TILE]`` tile: one load instruction stream with no branch between
the blocks, so every load of the program is in flight at once (memory
parallelism is what a memory-bound kernel lives on). Only an item that
reaches past its tensor's end takes the masked path, which masks the words
past the end and the bytes past the end within the last word.

Lane C is never computed word by word. With ``x = lo + 2**16 * hi``,
``rot16(x) = 2**16 * lo + hi``, so mod 2**32
``C = sum rot16(x) * w = 2**16 * A + Q`` where ``Q = sum hi * w`` (the
``2**32 * hi`` term of ``2**16 * A`` vanishes). The kernel sums A, B and Q
(two multiply-adds and one shift-multiply-add per word instead of the
rotation's four operations and a multiply-add) and adds ``(A << 16) + Q`` of
its own partial sums into lane C: the map is linear, so per-program parts
add up to the whole tensor's C. The lanes are the same numbers as before
(the torch reference computes C by its definition; the tests hold them
equal).

Lanes sit in 32-bit unsigned arithmetic (wrap-around addition is exactly
the mod 2**32 sum) and are added into ``out[segment]`` with 32-bit atomics,
so the order programs finish in changes nothing.
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
    r = tl.arange(0, ITERS)
    wa = tl.load(ta + sub * TILE + j).to(tl.uint32, bitcast=True)
    blk = group * ITERS + r  # [ITERS] 4096-word block indices within the tensor
    # KB = 0x9E3779B1 as an int32 bit pattern: a literal above 2**31 would promote to int64.
    kb = tl.full((), -1640531535, tl.int32).to(tl.uint32, bitcast=True)
    wb = tl.load(tb + (blk & 4095)).to(tl.uint32, bitcast=True)
    wb = (wb + (blk >> 12).to(tl.uint32) * kb) | 1
    first = group * ITERS * 4096 + sub * TILE  # first word of this program within the tensor
    ptr = words + tl.multiple_of(word0 + first, 64)
    offs = r[:, None] * 4096 + j[None, :]  # int32 word offsets from ``first``
    last_end = (first + (ITERS - 1) * 4096 + TILE) * 4  # byte just past the tile's last word
    if last_end <= nbytes:
        x = tl.load(ptr + offs).to(tl.uint32, bitcast=True)
    else:
        valid = nbytes - (first + offs.to(tl.int64)) * 4  # bytes of the tensor from each word on
        x = tl.load(ptr + offs, mask=valid > 0, other=0).to(tl.uint32, bitcast=True)
        shift = (tl.minimum(tl.maximum(valid, 0), 3) * 8).to(tl.uint32)
        x = tl.where(valid >= 4, x, x & ((tl.full([ITERS, TILE], 1, tl.uint32) << shift) - 1))
    a = tl.sum(tl.sum(x * wa[None, :], axis=1), axis=0)
    b = tl.sum(tl.sum(x * wb[:, None], axis=1), axis=0)
    q = tl.sum(tl.sum((x >> 16) * wa[None, :], axis=1), axis=0)
    c = (a << 16) + q
    tl.atomic_add(out + seg * 3 + 0, a.to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 1, b.to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 2, c.to(tl.int32, bitcast=True))
