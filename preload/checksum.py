"""Resident-weight checksums: did anything write into the daemon's weights?

A CUDA arena cannot be sealed: an engine attached zero-copy holds writable
views of the daemon's memory, and a bug (an in-place op on a weight, a
quantizer that repacks in place) changes what every later engine gets. The
content digest cannot see that: it proved the bytes the daemon *read*. So
the daemon checksums each tensor once after loading, and an engine checks
the tensors it attached against those checksums (``verify_resident``)
before trusting them. On an 8 GB arena that costs one pass over HBM.

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

On CUDA with Triton, one kernel launch covers the whole arena (one program
per 4096-word block of a tensor, lanes summed with 32-bit atomics). The
torch fallback computes the same numbers tensor by tensor, and is what runs
on CPU and in CI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from preload.errors import PreloadGateError
from preload.transports.base import Layout

SCHEME = "wsum32x3-v1"
BLOCK_WORDS = 4096
_TABLE = 4096
_KB = 0x9E3779B1
_MASK = 0xFFFFFFFF
_FALLBACK_CHUNK_WORDS = 1 << 24


class ResidentWeightsChangedError(PreloadGateError):
    """Attached weights differ from the checksums the daemon took after loading."""

    def __init__(self, changed: list[str], checked: int) -> None:
        self.changed = list(changed)
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        super().__init__(
            f"{len(changed)} of {checked} resident tensors changed since the daemon loaded them "
            f"({shown}): an earlier zero-copy engine wrote into the daemon's weights; "
            "restart the daemon (preload-gate preload CKPT) to reload them from the checkpoint"
        )


def _splitmix32(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic pseudo-random odd uint32 values (no RNG library state)."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    x &= np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return ((x & np.uint64(_MASK)) | np.uint64(1)).astype(np.uint32)


_TA = _splitmix32(0xA11CE, _TABLE)
_TB = _splitmix32(0xB0B, _TABLE)
_Tables = tuple[torch.Tensor, torch.Tensor]
_tables: dict[tuple[torch.device, torch.dtype], _Tables] = {}


def _device_tables(device: torch.device, dtype: torch.dtype) -> _Tables:
    """The weight tables as int64 (torch path) or int32 bit patterns (kernel)."""
    key = (torch.device(device), dtype)
    if key not in _tables:
        if dtype == torch.int32:
            conv = [torch.from_numpy(t.view(np.int32).copy()) for t in (_TA, _TB)]
        else:
            conv = [torch.from_numpy(t.astype(np.int64)) for t in (_TA, _TB)]
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
        a, b, c = (int(v) & _MASK for v in lanes)
        return cls(a, b, c)


# ---------------------------------------------------------------- fallback


def _words(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """uint8 bytes -> int64 tensor of little-endian 32-bit words (zero-padded)."""
    nbytes = flat.numel()
    if flat.storage_offset() % 4:
        flat = flat.clone()  # a 32-bit view needs 4-byte alignment
    pad = -nbytes % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).to(torch.int64) & _MASK
    return words, nbytes


def _lanes_torch(flat: torch.Tensor) -> Checksum:
    """The reference computation, chunked so temporaries stay bounded."""
    ta, tb = _device_tables(flat.device, torch.int64)
    nwords = -(-flat.numel() // 4)
    a = b = c = torch.zeros((), dtype=torch.int64, device=flat.device)
    for k0 in range(0, nwords, _FALLBACK_CHUNK_WORDS):
        k1 = min(nwords, k0 + _FALLBACK_CHUNK_WORDS)
        x, _ = _words(flat[k0 * 4 : min(k1 * 4, flat.numel())])
        k = torch.arange(k0, k1, dtype=torch.int64, device=flat.device)
        idx = k & (_TABLE - 1)
        blk = k >> 12
        wb = ((tb[blk & (_TABLE - 1)] + (blk >> 12) * _KB) & _MASK) | 1
        rot = ((x << 16) | (x >> 16)) & _MASK
        # int64 products wrap mod 2**64 (two's complement), which keeps them right mod 2**32.
        a = a + ((x * ta[idx]) & _MASK).sum()
        b = b + ((x * wb) & _MASK).sum()
        c = c + ((rot * ta[idx]) & _MASK).sum()
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


# ---------------------------------------------------------------- triton

_kernel: Any = None


def _triton_kernel() -> Any:
    """The compiled-on-first-use Triton kernel; None where Triton is unusable."""
    global _kernel
    if _kernel is None:
        try:
            from preload._checksum_kernel import wsum
        except Exception:  # noqa: BLE001 - any import failure means "no Triton here"
            wsum = False
        _kernel = wsum
    return _kernel or None


@dataclass(frozen=True)
class _Plan:
    """Per-layout program tables on one device."""

    seg_of_prog: torch.Tensor
    seg_prog0: torch.Tensor
    seg_word0: torch.Tensor
    seg_nbytes: torch.Tensor
    programs: int


# Tuned on an H200 (docs/gpu-results.json: the sweep in the gpu_checksum row).
KERNEL_ITERS = 4
KERNEL_WARPS = 4


def _plan(layout: Layout, device: torch.device, iters: int) -> _Plan:
    per_prog = 4 * BLOCK_WORDS * iters
    progs = np.array([-(-e.nbytes // per_prog) for e in layout.entries], dtype=np.int64)
    prog0 = np.zeros(len(progs), dtype=np.int64)
    if len(progs):
        prog0[1:] = np.cumsum(progs)[:-1]
    # One host-to-device copy for all four small tables.
    table = np.stack([
        progs, prog0,
        np.array([e.offset // 4 for e in layout.entries], dtype=np.int64),
        np.array([e.nbytes for e in layout.entries], dtype=np.int64),
    ]) if len(progs) else np.zeros((4, 0), dtype=np.int64)
    dev = torch.from_numpy(table).to(device)
    programs = int(progs.sum())
    seg_ids = torch.arange(len(progs), dtype=torch.int32, device=device)
    return _Plan(
        seg_of_prog=torch.repeat_interleave(seg_ids, dev[0], output_size=programs),
        seg_prog0=dev[1].contiguous(), seg_word0=dev[2].contiguous(), seg_nbytes=dev[3].contiguous(),
        programs=programs,
    )


def _lanes_triton(
    base: torch.Tensor, layout: Layout, iters: int | None = None, warps: int | None = None
) -> torch.Tensor | None:
    """All tensors' lanes in one launch, as an int32 ``[n, 3]`` device tensor."""
    kernel = _triton_kernel()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # tests run the kernel on CPU
    if kernel is None or (base.device.type != "cuda" and not interpret):
        return None
    # The kernel's vector loads assume 256-byte aligned tensors (Layout.plan's ALIGN).
    if any(e.offset % 256 for e in layout.entries) or base.numel() % 4 or base.data_ptr() % 16:
        return None
    iters = iters or KERNEL_ITERS
    plan = _plan(layout, base.device, iters)
    out = torch.zeros((len(layout.entries), 3), dtype=torch.int32, device=base.device)
    if plan.programs:
        ta, tb = _device_tables(base.device, torch.int32)
        kernel[(plan.programs,)](
            base.view(torch.int32), plan.seg_of_prog, plan.seg_prog0, plan.seg_word0,
            plan.seg_nbytes, ta, tb, out, BLOCK=BLOCK_WORDS, ITERS=iters,
            num_warps=warps or KERNEL_WARPS,
        )
    return out


# ---------------------------------------------------------------- public face


def arena_base(tensors: Mapping[str, torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The flat uint8 arena the tensors are views of, or None if they are not.

    Works for any transport whose views share one storage starting at the
    arena's first byte (shm and cuda arenas both do); checked, not assumed.
    """
    if not layout.entries:
        return None
    first = tensors.get(layout.entries[0].name)
    if first is None:
        return None
    storage = first.untyped_storage()
    if storage.nbytes() < layout.total_bytes:
        return None
    base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (layout.total_bytes,), (1,))
    origin = base.data_ptr()
    for e in layout.entries:
        t = tensors.get(e.name)
        # Same address and size means the entry's bytes are the tensor's bytes
        # (cheaper than asking each tensor for its storage object).
        if t is None or t.device != base.device:
            return None
        if e.nbytes and (
            t.data_ptr() - origin != e.offset or t.numel() * t.element_size() != e.nbytes or not t.is_contiguous()
        ):
            return None
    return base


def checksum_tensors(
    tensors: Mapping[str, torch.Tensor], layout: Layout, backend: str = "auto"
) -> dict[str, str]:
    """Checksums of every layout entry, keyed by name (24 hex digits each).

    ``backend``: ``auto`` (one Triton launch over the arena on CUDA, else
    torch), ``triton`` (fail if unusable) or ``torch`` (the reference).

    >>> sums = checksum_tensors(arena.views(), arena.layout)   # doctest: +SKIP
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown checksum backend {backend!r}")
    missing = [e.name for e in layout.entries if e.name not in tensors]
    if missing:
        raise ValueError(f"no tensor for layout entries {missing[:5]}")
    if backend != "torch":
        base = arena_base(tensors, layout)
        lanes = _lanes_triton(base, layout) if base is not None else None
        if lanes is not None:
            rows = lanes.cpu().tolist()
            return {e.name: Checksum.from_lanes(r).hex() for e, r in zip(layout.entries, rows, strict=True)}
        if backend == "triton":
            raise RuntimeError("the triton checksum needs CUDA, Triton and one shared arena")
    return {e.name: tensor_checksum(tensors[e.name]) for e in layout.entries}


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_resident`` checked (it raises when anything changed)."""

    tensors: int
    bytes: int
    scheme: str = SCHEME


def verify_resident(
    tensors: Mapping[str, torch.Tensor],
    layout: Layout,
    expected: Mapping[str, str],
    backend: str = "auto",
) -> VerifyReport:
    """Check attached tensors against the daemon's checksums.

    Raises :class:`ResidentWeightsChangedError` naming every changed tensor,
    or when the daemon sent no checksum for an entry (an unchecked tensor is
    not a passed one).
    """
    unchecked = [e.name for e in layout.entries if e.name not in expected]
    if unchecked:
        raise ResidentWeightsChangedError(
            [f"{n} (no checksum from the daemon)" for n in unchecked], len(layout.entries)
        )
    got = checksum_tensors(tensors, layout, backend=backend)
    changed = [e.name for e in layout.entries if got[e.name] != expected[e.name]]
    if changed:
        raise ResidentWeightsChangedError(changed, len(layout.entries))
    return VerifyReport(len(layout.entries), sum(e.nbytes for e in layout.entries))


def resident_checksums(arena: Any, views: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The daemon's checksums after loading, for arenas engines can write into.

    A sealed memfd cannot change, so shm arenas need none (and computing
    them on CPU would slow every load for nothing); a CUDA arena has no
    seal, so it gets one checksum per tensor. Call before sharing.
    """
    if not getattr(arena, "engines_can_write", False):
        return {}
    return checksum_tensors(views, arena.layout)
