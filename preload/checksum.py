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
per tile of a few 4096-word blocks of a tensor, lanes summed with 32-bit
atomics; see ``preload._checksum_kernel``). The
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
class KernelShape:
    """How the kernel cuts the work: ``tile`` words of ``iters`` blocks per program.

    Any shape gives the same lanes (the unit and GPU tests check several);
    it only changes the speed. Defaults tuned on an H200
    (``scripts/checksum_sweep.py``, figures in docs/gpu-results.json);
    ``PRELOAD_GATE_CHECKSUM_KERNEL=TILE,ITERS,WARPS`` overrides them, for
    tuning on another GPU.
    """

    tile: int = 4096
    iters: int = 4
    warps: int = 8

    def __post_init__(self) -> None:
        if self.tile not in (256, 512, 1024, 2048, 4096):
            raise ChecksumSettingsError(f"checksum kernel tile {self.tile} is not a power of two in 256..4096")
        if not 1 <= self.iters <= 64 or self.warps not in (1, 2, 4, 8, 16, 32):
            raise ChecksumSettingsError(
                f"checksum kernel iters {self.iters} (1..64) or warps {self.warps} (a power of two <= 32) out of range"
            )

    @classmethod
    def from_env(cls) -> KernelShape:
        raw = os.environ.get(SHAPE_ENV, "").strip()
        if not raw:
            return cls()
        try:
            tile, iters, warps = (int(v) for v in raw.split(","))
        except ValueError:
            raise ChecksumSettingsError(f"{SHAPE_ENV}={raw!r} is not TILE,ITERS,WARPS (three integers)") from None
        return cls(tile, iters, warps)


class ChecksumSettingsError(PreloadGateError):
    """A checksum kernel setting that cannot work."""


SHAPE_ENV = "PRELOAD_GATE_CHECKSUM_KERNEL"


@dataclass(frozen=True)
class _Plan:
    """Per-layout program tables on one device (built once per layout and shape)."""

    seg_of_prog: torch.Tensor
    seg_prog0: torch.Tensor
    seg_word0: torch.Tensor
    seg_nbytes: torch.Tensor
    programs: int


@dataclass(frozen=True)
class _LayoutFacts:
    """What ``arena_base`` and result formatting need from a layout, as arrays."""

    names: tuple[str, ...]
    offsets: np.ndarray  # int64, bytes from the arena's start
    nbytes: np.ndarray  # int64
    aligned: bool  # every entry 256-byte aligned (the kernel's vector loads need it)


_CACHE_SIZE = 8
_facts: dict[int, tuple[Layout, _LayoutFacts]] = {}
_plans: dict[tuple[int, torch.device, int, int], tuple[Layout, _Plan]] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _layout_facts(layout: Layout) -> _LayoutFacts:
    """Cached per layout object: a verify loop over the same layout pays once.

    Keyed by identity (hashing a 320-entry layout costs more than the
    lookup saves); the cache holds the layout, so its id cannot be reused.
    """
    hit = _facts.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    entries = layout.entries
    offsets = np.fromiter((e.offset for e in entries), dtype=np.int64, count=len(entries))
    nbytes = np.fromiter((e.nbytes for e in entries), dtype=np.int64, count=len(entries))
    facts = _LayoutFacts(tuple(e.name for e in entries), offsets, nbytes, not bool((offsets % 256).any()))
    _remember(_facts, id(layout), (layout, facts))
    return facts


def _plan(layout: Layout, device: torch.device, tile: int, iters: int) -> _Plan:
    """Which tensor each program works on, and where that tensor starts."""
    key = (id(layout), device, tile, iters)
    hit = _plans.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    facts = _layout_facts(layout)
    blocks = -(-facts.nbytes // (4 * BLOCK_WORDS))
    progs = -(-blocks // iters) * (BLOCK_WORDS // tile)
    prog0 = np.zeros(len(progs), dtype=np.int64)
    if len(progs):
        prog0[1:] = np.cumsum(progs)[:-1]
    programs = int(progs.sum())
    # One small host-to-device copy; the per-program table is expanded on the
    # device (output_size given, so no synchronisation to learn its length).
    dev = torch.from_numpy(np.concatenate([progs, prog0, facts.offsets // 4, facts.nbytes])).to(device)
    n = len(progs)
    seg_ids = torch.arange(n, dtype=torch.int32, device=device)
    plan = _Plan(
        seg_of_prog=torch.repeat_interleave(seg_ids, dev[:n], output_size=programs),
        seg_prog0=dev[n : 2 * n], seg_word0=dev[2 * n : 3 * n], seg_nbytes=dev[3 * n :], programs=programs,
    )
    _remember(_plans, key, (layout, plan))
    return plan


def _lanes_triton(
    base: torch.Tensor, layout: Layout, iters: int | None = None, warps: int | None = None,
    tile: int | None = None,
) -> torch.Tensor | None:
    """All tensors' lanes in one launch, as an int32 ``[n, 3]`` device tensor."""
    kernel = _triton_kernel()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # tests run the kernel on CPU
    if kernel is None or (base.device.type != "cuda" and not interpret):
        return None
    # The kernel's vector loads assume 256-byte aligned tensors (Layout.plan's ALIGN).
    if not _layout_facts(layout).aligned or base.numel() % 4 or base.data_ptr() % 16:
        return None
    default = KernelShape.from_env()
    shape = KernelShape(tile or default.tile, iters or default.iters, warps or default.warps)
    plan = _plan(layout, base.device, shape.tile, shape.iters)
    out = torch.zeros((len(layout.entries), 3), dtype=torch.int32, device=base.device)
    if plan.programs:
        ta, tb = _device_tables(base.device, torch.int32)
        kernel[(plan.programs,)](
            base.view(torch.int32), plan.seg_of_prog, plan.seg_prog0, plan.seg_word0,
            plan.seg_nbytes, ta, tb, out, TILE=shape.tile, ITERS=shape.iters, num_warps=shape.warps,
        )
    return out


def _hex_rows(lanes: torch.Tensor) -> list[str]:
    """``[n, 3]`` int32 lanes -> n strings of 24 hex digits, like ``Checksum.hex``.

    One device-to-host copy and one ``bytes.hex`` (big-endian words print
    as their own hex digits) instead of a Python loop over every lane.
    """
    digits = lanes.cpu().numpy().astype(">u4").tobytes().hex()
    return [digits[i : i + 24] for i in range(0, len(digits), 24)]


# ---------------------------------------------------------------- public face


def _storage_base(first: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """The flat uint8 view of ``first``'s storage over the layout's bytes, if it is that large."""
    storage = first.untyped_storage()
    if storage.nbytes() < layout.total_bytes:
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (layout.total_bytes,), (1,))


def _views_of(base: torch.Tensor, views: list[torch.Tensor], facts: _LayoutFacts) -> bool:
    """Is every tensor its layout entry's bytes of ``base``?

    Same address and size, contiguous, same device means the entry's bytes
    are the tensor's bytes (cheaper than asking each tensor for its storage
    object); compared as arrays, so a 320-tensor rank costs four list passes.
    """
    n = len(views)
    ptrs = np.fromiter((t.data_ptr() for t in views), dtype=np.int64, count=n)
    sizes = np.fromiter((t.nbytes for t in views), dtype=np.int64, count=n)
    devices = np.fromiter((t.get_device() for t in views), dtype=np.int64, count=n)
    contiguous = np.fromiter((t.is_contiguous() for t in views), dtype=bool, count=n)
    ok = (ptrs - base.data_ptr() == facts.offsets) & (sizes == facts.nbytes) & contiguous
    used = facts.nbytes > 0  # an empty tensor's address means nothing
    return bool(ok[used].all()) and bool((devices == base.get_device()).all())


def arena_base(tensors: Mapping[str, torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The flat uint8 arena the tensors are views of, or None if they are not.

    Works for any transport whose views share one storage starting at the
    arena's first byte (shm and cuda arenas both do); checked, not assumed:
    every non-empty tensor must start at its entry's offset, span its
    entry's bytes, be contiguous and sit on the arena's device.
    """
    if not layout.entries:
        return None
    facts = _layout_facts(layout)
    try:
        views = [tensors[n] for n in facts.names]
    except KeyError:
        return None
    base = _storage_base(views[0], layout)
    return base if base is not None and _views_of(base, views, facts) else None


def checksum_tensors(
    tensors: Mapping[str, torch.Tensor], layout: Layout, backend: str = "auto"
) -> dict[str, str]:
    """Checksums of every layout entry, keyed by name (24 hex digits each).

    ``backend``: ``auto`` (one Triton launch over the arena on CUDA, else
    torch), ``triton`` (fail if unusable) or ``torch`` (the reference).

    On the Triton path the kernel is launched over the first tensor's
    storage *before* the host checks that every tensor is its entry's view
    of that storage (``arena_base``'s check): the check then runs while the
    GPU reads, instead of before it. The kernel only reads bytes inside that
    storage, and a failed check discards its result for the per-tensor path,
    so the answer is the same as checking first.

    >>> sums = checksum_tensors(arena.views(), arena.layout)   # doctest: +SKIP
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown checksum backend {backend!r}")
    facts = _layout_facts(layout)
    try:
        views = [tensors[n] for n in facts.names]
    except KeyError:
        missing = [n for n in facts.names if n not in tensors]
        raise ValueError(f"no tensor for layout entries {missing[:5]}") from None
    if backend != "torch":
        base = _storage_base(views[0], layout) if views else None
        lanes = _lanes_triton(base, layout) if base is not None else None
        if base is not None and lanes is not None and _views_of(base, views, facts):
            return dict(zip(facts.names, _hex_rows(lanes), strict=True))
        if backend == "triton":
            raise RuntimeError("the triton checksum needs CUDA, Triton and one shared arena")
    return {e.name: tensor_checksum(t) for e, t in zip(layout.entries, views, strict=True)}


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
