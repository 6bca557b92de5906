"""Launching the Triton checksum: kernel shape, per-layout program tables, lanes.

On CUDA with Triton, one kernel launch covers the whole arena (one program
per tile of a few 4096-word blocks of a tensor, lanes summed with 32-bit
atomics; see :mod:`preload.checksum.kernel`). This module cuts the work
into programs and launches them; where Triton or CUDA is missing it
answers None and the caller takes the torch path
(:mod:`preload.checksum.reference`), which gives the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pgbase.errors import PreloadGateError
from preload.checksum.scheme import BLOCK_WORDS, device_tables
from preload.transports.base import Layout

_kernel: Any = None


def _triton_kernel() -> Any:
    """The compiled-on-first-use Triton kernel; None where Triton is unusable."""
    global _kernel
    if _kernel is None:
        try:
            from preload.checksum.kernel import wsum
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
    iters: int = 16
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
class ProgramPlan:
    """Per-layout program tables on one device (built once per layout and shape)."""

    seg_of_prog: torch.Tensor
    seg_prog0: torch.Tensor
    seg_word0: torch.Tensor
    seg_nbytes: torch.Tensor
    programs: int


@dataclass(frozen=True)
class LayoutFacts:
    """What ``arena_base`` and result formatting need from a layout, as arrays."""

    names: tuple[str, ...]
    offsets: np.ndarray  # int64, bytes from the arena's start
    nbytes: np.ndarray  # int64
    aligned: bool  # every entry 256-byte aligned (the kernel's vector loads need it)


_CACHE_SIZE = 8
_facts: dict[int, tuple[Layout, LayoutFacts]] = {}
_plans: dict[tuple[int, torch.device, int, int], tuple[Layout, ProgramPlan]] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_SIZE:
        cache.pop(next(iter(cache)))
    cache[key] = value


def layout_facts(layout: Layout) -> LayoutFacts:
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
    facts = LayoutFacts(tuple(e.name for e in entries), offsets, nbytes, not bool((offsets % 256).any()))
    _remember(_facts, id(layout), (layout, facts))
    return facts


def plan_programs(layout: Layout, device: torch.device, tile: int, iters: int) -> ProgramPlan:
    """Which tensor each program works on, and where that tensor starts."""
    key = (id(layout), device, tile, iters)
    hit = _plans.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    facts = layout_facts(layout)
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
    plan = ProgramPlan(
        seg_of_prog=torch.repeat_interleave(seg_ids, dev[:n], output_size=programs),
        seg_prog0=dev[n : 2 * n], seg_word0=dev[2 * n : 3 * n], seg_nbytes=dev[3 * n :], programs=programs,
    )
    _remember(_plans, key, (layout, plan))
    return plan


def lanes_triton(
    base: torch.Tensor, layout: Layout, iters: int | None = None, warps: int | None = None,
    tile: int | None = None,
) -> torch.Tensor | None:
    """All tensors' lanes in one launch, as an int32 ``[n, 3]`` device tensor."""
    kernel = _triton_kernel()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # tests run the kernel on CPU
    if kernel is None or (base.device.type != "cuda" and not interpret):
        return None
    # The kernel's vector loads assume 256-byte aligned tensors (Layout.plan's ALIGN).
    if not layout_facts(layout).aligned or base.numel() % 4 or base.data_ptr() % 16:
        return None
    default = KernelShape.from_env()
    shape = KernelShape(tile or default.tile, iters or default.iters, warps or default.warps)
    plan = plan_programs(layout, base.device, shape.tile, shape.iters)
    out = torch.zeros((len(layout.entries), 3), dtype=torch.int32, device=base.device)
    if plan.programs:
        ta, tb = device_tables(base.device, torch.int32)
        kernel[(plan.programs,)](
            base.view(torch.int32), plan.seg_of_prog, plan.seg_prog0, plan.seg_word0,
            plan.seg_nbytes, ta, tb, out, TILE=shape.tile, ITERS=shape.iters, num_warps=shape.warps,
        )
    return out


def hex_rows(lanes: torch.Tensor) -> list[str]:
    """``[n, 3]`` int32 lanes -> n strings of 24 hex digits, like ``Checksum.hex``.

    One device-to-host copy and one ``bytes.hex`` (big-endian words print
    as their own hex digits) instead of a Python loop over every lane.
    """
    digits = lanes.cpu().numpy().astype(">u4").tobytes().hex()
    return [digits[i : i + 24] for i in range(0, len(digits), 24)]


def warm(device: torch.device | str) -> float:
    """Compile (or load from Triton's cache) and run the kernel once on a
    small arena on ``device``, with the shape ``checksum_tensors`` uses; the
    seconds it took. A successor daemon calls it before it times a
    re-adoption, as a loading daemon's first checksum pays it before its
    first engine. Nothing happens (0.0) where the Triton path cannot run."""
    import time

    from preload.transports.base import Layout

    t0 = time.perf_counter()
    layout = Layout.plan([("warm", torch.int32, (2 * BLOCK_WORDS + 3,), "param")])
    base = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    lanes = lanes_triton(base, layout)
    if lanes is None:
        return 0.0
    lanes.cpu()
    return time.perf_counter() - t0
