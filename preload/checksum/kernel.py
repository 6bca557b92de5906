"""The Triton kernel behind ``preload.checksum`` (the math: :mod:`preload.checksum.scheme`).

Kept in its own module, at module level and without
``from __future__ import annotations``: Triton resolves names through the
kernel function's globals and reads ``tl.constexpr`` annotations as
objects, so a kernel nested in a function or with string annotations is
fragile across Triton releases. Importing this module fails where Triton is
missing; ``preload.checksum`` then uses its torch path.

The checksum's weights repeat every 4096 words (lane A's table) and change
once per 4096-word block (lane B's). A program covers one ``TILE``-word
slice (``sub``) of ``ITERS`` consecutive blocks of one tensor, with the
``TILE`` table weights of its slice loaded once. A program that lies wholly
inside its tensor (all but the last of each tensor) takes a path with no
mask and no branch between its blocks, so all its loads can be in flight at
once (memory parallelism is what a memory-bound kernel lives on); only the
last takes the masked path, which masks the words past the tensor's end and
the bytes past the end within the last word. Data loads are marked
``evict_first``: each byte is read once, and the weight tables should stay
in L2.

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
    wa = tl.load(ta + sub * TILE + j).to(tl.uint32, bitcast=True)
    # KB = 0x9E3779B1 as an int32 bit pattern: a literal above 2**31 would promote to int64.
    kb = tl.full((), -1640531535, tl.int32).to(tl.uint32, bitcast=True)
    first = group * ITERS * 4096 + sub * TILE  # first word of this program within the tensor
    ptr = words + tl.multiple_of(word0 + first, 64)
    acc_a = tl.zeros([TILE], dtype=tl.uint32)
    acc_b = tl.zeros([TILE], dtype=tl.uint32)
    acc_q = tl.zeros([TILE], dtype=tl.uint32)
    if (first + (ITERS - 1) * 4096 + TILE) * 4 <= nbytes:
        # The whole program lies inside its tensor: no mask and no branch
        # between the blocks, so all ITERS loads can be in flight at once.
        for it in tl.static_range(ITERS):
            x = tl.load(ptr + it * 4096 + j, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            blk = group * ITERS + it
            wb = (tl.load(tb + (blk & 4095)).to(tl.uint32, bitcast=True) + (blk >> 12).to(tl.uint32) * kb) | 1
            acc_a += x * wa
            acc_b += x * wb
            acc_q += (x >> 16) * wa
    else:
        for it in tl.static_range(ITERS):
            # bytes of the tensor from this tile on; small here (the tensor ends within this program)
            left = nbytes - (first + it * 4096) * 4
            valid = tl.maximum(left, 0).to(tl.int32) - j * 4
            x = tl.load(ptr + it * 4096 + j, mask=valid > 0, other=0).to(tl.uint32, bitcast=True)
            shift = (tl.minimum(tl.maximum(valid, 0), 3) * 8).to(tl.uint32)
            x = tl.where(valid >= 4, x, x & ((tl.full([TILE], 1, tl.uint32) << shift) - 1))
            blk = group * ITERS + it
            wb = (tl.load(tb + (blk & 4095)).to(tl.uint32, bitcast=True) + (blk >> 12).to(tl.uint32) * kb) | 1
            acc_a += x * wa
            acc_b += x * wb
            acc_q += (x >> 16) * wa
    a = tl.sum(acc_a, axis=0)
    b = tl.sum(acc_b, axis=0)
    c = (a << 16) + tl.sum(acc_q, axis=0)
    tl.atomic_add(out + seg * 3 + 0, a.to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 1, b.to(tl.int32, bitcast=True))
    tl.atomic_add(out + seg * 3 + 2, c.to(tl.int32, bitcast=True))
