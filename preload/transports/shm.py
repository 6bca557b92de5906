"""CPU transport: one sealed memfd per rank, mapped copy-on-write by engines.

The daemon fills the memfd through a writable shared mapping, unmaps it (a
writable shared mapping blocks ``F_SEAL_WRITE``), then seals it
``F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL``: from then on nobody,
the daemon included, can change, resize or unseal its bytes. Engines get the
fd over ``SCM_RIGHTS`` and map it ``MAP_PRIVATE``: pages are shared with the
daemon until an engine writes one, and that write lands in the engine's own
copy. Attach refuses a memfd whose seals are missing, so an engine never
maps memory another process could still change under it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

import numpy as np
import torch

from pgbase.errors import WeightCacheUnavailableError
from pgbase.oscause import describe
from preload.transports.base import Arena, Attachment, Layout, Transport, view

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
SEALS = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
_SEAL_NAMES = {F_SEAL_SEAL: "seal", F_SEAL_SHRINK: "shrink", F_SEAL_GROW: "grow", F_SEAL_WRITE: "write"}


def seal_names(seals: int) -> list[str]:
    return [name for bit, name in _SEAL_NAMES.items() if seals & bit]


def _buffer_tensor(mapping: mmap.mmap) -> torch.Tensor:
    """A flat uint8 tensor over ``mapping`` that pins it.

    Through numpy, every view holds a buffer export of the mmap, so
    ``mmap.close()`` raises BufferError while any tensor still points into it
    (``torch.frombuffer`` holds no export: closing would leave tensors
    pointing at unmapped memory).
    """
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))


class ShmArena(Arena):
    """A memfd arena; ``views()`` are writable until ``seal()``."""

    # Sealed F_SEAL_WRITE and mapped MAP_PRIVATE: an engine's write lands in
    # its own copy-on-write page, never in these bytes.
    engines_can_write = False

    def __init__(self, layout: Layout, name: str = "preload-gate-arena") -> None:
        self.layout = layout
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, layout.total_bytes)
            self._map: mmap.mmap | None = mmap.mmap(
                self.fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(self.fd)
            raise
        self._views: dict[str, torch.Tensor] | None = None
        self.sealed = False

    def views(self) -> dict[str, torch.Tensor]:
        if self.sealed or self._map is None:
            raise RuntimeError("the arena is sealed; its views are gone")
        if self._views is None:
            base = _buffer_tensor(self._map)
            self._views = {e.name: view(base, e) for e in self.layout.entries}
        return self._views

    def seal(self) -> None:
        """Unmap the writable mapping, then seal. Every view must be dropped first."""
        if self.sealed:
            return
        self._views = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError as exc:
                raise RuntimeError(
                    "cannot seal the arena: a tensor still references its writable mapping "
                    "(drop the model and every view before sealing)"
                ) from exc
            self._map = None
        fcntl.fcntl(self.fd, F_ADD_SEALS, SEALS)
        self.sealed = True

    def descriptor(self) -> dict[str, Any]:
        if not self.sealed:
            raise RuntimeError("an unsealed arena must not be shared")
        return {"kind": "shm", "size": self.layout.total_bytes, "seals": seal_names(SEALS)}

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        self._views = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmAttachment(Attachment):
    def __init__(self, mapping: mmap.mmap, tensors: dict[str, torch.Tensor]) -> None:
        self._map: mmap.mmap | None = mapping
        self.tensors = tensors

    def close(self) -> None:
        # The mapping lives while any tensor (a model parameter) references it;
        # dropping our references is all that is safe to do here.
        self.tensors = {}
        self._map = None


class ShmTransport(Transport):
    """Sealed memfd arenas; engines map them MAP_PRIVATE (copy-on-write)."""

    name = "shm"
    engines_can_write = ShmArena.engines_can_write

    def create(self, layout: Layout) -> ShmArena:
        return ShmArena(layout)

    def attach(self, descriptor: dict[str, Any], fds: list[int], layout: Layout) -> ShmAttachment:
        """Map the daemon's sealed memfd privately and return typed views.

        Takes ownership of ``fds`` (closed here; the mapping outlives them).
        """
        try:
            if descriptor.get("kind") != "shm":
                raise WeightCacheUnavailableError(
                    f"descriptor is for transport {descriptor.get('kind')!r}, not shm"
                )
            if len(fds) != 1:
                raise WeightCacheUnavailableError(f"shm attach needs exactly one fd, got {len(fds)}")
            fd = fds[0]
            size = os.fstat(fd).st_size
            if size != descriptor.get("size") or size != layout.total_bytes:
                raise WeightCacheUnavailableError(
                    f"arena is {size} bytes; the daemon described {descriptor.get('size')} "
                    f"and its layout needs {layout.total_bytes}"
                )
            try:
                seals = fcntl.fcntl(fd, F_GET_SEALS)
            except OSError as exc:
                raise WeightCacheUnavailableError(f"arena fd cannot be sealed (not a memfd): {exc}") from exc
            missing = seal_names(SEALS & ~seals)
            if missing:
                raise WeightCacheUnavailableError(
                    f"arena memfd lacks seals {missing}: another process could still change it"
                )
            try:
                mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:  # an engine out of address space or mappings: named, not "attach failed"
                raise WeightCacheUnavailableError(f"cannot map the daemon's {size}-byte arena: {describe(exc)}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        base = _buffer_tensor(mapping)
        return ShmAttachment(mapping, {e.name: view(base, e) for e in layout.entries})
