"""Checksums of an arena's tensors, and the engine-side check against them.

A CUDA arena cannot be sealed: an engine attached zero-copy holds writable
views of the daemon's memory, and a bug (an in-place op on a weight, a
quantizer that repacks in place) changes what every later engine gets. The
content digest cannot see that: it proved the bytes the daemon *read*. So
the daemon checksums each tensor once after loading, and an engine checks
the tensors it attached against those checksums (``verify_resident``)
before trusting them. On an 8 GB arena that costs one pass over HBM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pgbase.errors import PreloadGateError
from preload.checksum.planner import LayoutFacts, hex_rows, lanes_triton, layout_facts
from preload.checksum.reference import tensor_checksum
from preload.checksum.scheme import SCHEME
from preload.transports.base import Arena, Layout, view


class ResidentWeightsChangedError(PreloadGateError):
    """Attached weights differ from the checksums the daemon took after loading."""

    def __init__(self, changed: list[str], checked: int) -> None:
        self.changed = list(changed)
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        # What changed, without the advice (the re-adoption proof words its own).
        self.summary = f"{len(changed)} of {checked} tensors ({shown})"
        super().__init__(
            f"{len(changed)} of {checked} resident tensors changed since the daemon loaded them "
            f"({shown}): an earlier zero-copy engine wrote into the daemon's weights; "
            "restart the daemon (preload-gate preload CKPT) to reload them from the checkpoint"
        )


def _storage_base(first: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """The flat uint8 view of ``first``'s storage over the layout's bytes, if it is that large."""
    storage = first.untyped_storage()
    if storage.nbytes() < layout.total_bytes:
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (layout.total_bytes,), (1,))


def _views_of(base: torch.Tensor, views: list[torch.Tensor], facts: LayoutFacts) -> bool:
    """Is every tensor its layout entry's bytes of ``base``?

    Same address and size, contiguous, means the entry's bytes are the
    tensor's bytes (cheaper than asking each tensor for its storage object).
    No device check: with unified addressing an address names one place,
    host or device, so the address match already says it. Compared as
    arrays, so a 320-tensor rank costs three list passes; on the Triton path
    they run while the kernel reads.
    """
    ptrs = np.array([t.data_ptr() for t in views], dtype=np.int64)
    sizes = np.array([t.nbytes for t in views], dtype=np.int64)
    contiguous = np.array([t.is_contiguous() for t in views], dtype=bool)
    ok = (ptrs - base.data_ptr() == facts.offsets) & (sizes == facts.nbytes) & contiguous
    used = facts.nbytes > 0  # an empty tensor's address means nothing
    return bool(ok[used].all())


def arena_base(tensors: Mapping[str, torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The flat uint8 arena the tensors are views of, or None if they are not.

    Works for any transport whose views share one storage starting at the
    arena's first byte (shm and cuda arenas both do); checked, not assumed:
    every non-empty tensor must start at its entry's offset, span its
    entry's bytes, be contiguous and sit on the arena's device.
    """
    if not layout.entries:
        return None
    facts = layout_facts(layout)
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
    facts = layout_facts(layout)
    try:
        views = [tensors[n] for n in facts.names]
    except KeyError:
        missing = [n for n in facts.names if n not in tensors]
        raise ValueError(f"no tensor for layout entries {missing[:5]}") from None
    if backend != "torch":
        base = _storage_base(views[0], layout) if views else None
        lanes = lanes_triton(base, layout) if base is not None else None
        if base is not None and lanes is not None and _views_of(base, views, facts):
            return dict(zip(facts.names, hex_rows(lanes), strict=True))
        if backend == "triton":
            raise RuntimeError("the triton checksum needs CUDA, Triton and one shared arena")
    return {e.name: tensor_checksum(t) for e, t in zip(layout.entries, views, strict=True)}


def arena_checksums(base: torch.Tensor, layout: Layout) -> dict[str, str]:
    """Checksums of every layout entry of a flat ``uint8`` arena the caller
    holds (an adopted arena: its views are its own, nothing to check), keyed
    by name: one Triton launch where it can run, else the torch path."""
    facts = layout_facts(layout)
    lanes = lanes_triton(base, layout)
    if lanes is not None:
        return dict(zip(facts.names, hex_rows(lanes), strict=True))
    return {e.name: tensor_checksum(view(base, e)) for e in layout.entries}


def changed_tensors(got: Mapping[str, str], layout: Layout, expected: Mapping[str, str]) -> list[str]:
    """Entries whose checksum is not the expected one, or has none (named so)."""
    return [e.name if e.name in expected else f"{e.name} (no checksum from the daemon)"
            for e in layout.entries if got.get(e.name) != expected.get(e.name)]


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
    changed = changed_tensors(got, layout, expected)
    if changed:
        raise ResidentWeightsChangedError(changed, len(layout.entries))
    return VerifyReport(len(layout.entries), sum(e.nbytes for e in layout.entries))


def resident_checksums(arena: Arena, views: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The daemon's checksums after loading, for arenas engines can write into.

    ``arena.engines_can_write`` decides: a sealed memfd cannot change, so
    shm arenas need none (and computing them on CPU would slow every load
    for nothing); a CUDA arena has no write seal, so it gets one checksum
    per tensor. Call before sealing.
    """
    if not arena.engines_can_write:
        return {}
    return checksum_tensors(views, arena.layout)
