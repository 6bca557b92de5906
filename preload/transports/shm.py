"""CPU transport: one sealed memfd per rank, mapped copy-on-write by engines.

The daemon fills the memfd through a writable shared mapping, unmaps it (a
writable shared mapping blocks ``F_SEAL_WRITE``), then seals it
``F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL``: from then on nobody,
the daemon included, can change, resize or unseal its bytes. Engines get the
fd over ``SCM_RIGHTS`` and map it ``MAP_PRIVATE``: pages are shared with the
daemon until an engine writes one, and that write lands in the engine's own
copy. Attach refuses a memfd whose seals are missing, so an engine never
maps memory another process could still change under it.

The same seals make an arena outlive its daemon safely (issue 26): a
sealed memfd lives while any process holds an fd or a mapping, so the
daemon deposits a duplicate fd in an fd store, and a successor
``adopt``s it. Its proof is the memfd itself: ``F_GET_SEALS`` showing the
write seal means nobody has changed a byte since the depositor hashed
them, and the size must be the layout's. No checksum is needed or taken.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pgbase.errors import WeightCacheUnavailableError
from preload.transports.base import (
    AdoptError,
    Arena,
    ArenaProofError,
    Attachment,
    Layout,
    Proof,
    Transport,
    view,
)

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

    def __init__(self, layout: Layout, name: str = "preload-gate-arena", fd: int | None = None) -> None:
        self.layout = layout
        self._map: mmap.mmap | None = None
        self._views: dict[str, torch.Tensor] | None = None
        if fd is not None:  # adopted: already sealed, never mapped writable here (ShmTransport.adopt)
            self.fd, self.sealed, self.adopted = fd, True, True
            return
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, layout.total_bytes)
            self._map = mmap.mmap(self.fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
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

    def deposit(self) -> tuple[dict[str, Any], list[int]]:
        """The descriptor engines get and a duplicate of the memfd (the caller's to close)."""
        descriptor = self.descriptor()  # refuses an unsealed arena
        return descriptor, [os.dup(self.fd)]

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

    def adopt(self, descriptor: dict[str, Any], fds: list[int], layout: Layout) -> ShmArena:
        """The deposited memfd as a sealed arena (takes ownership of ``fds``).

        Shape only: one fd, a shm descriptor whose size is the layout's.
        Seals and the fd's real size are :meth:`prove`'s.
        """
        try:
            if descriptor.get("kind") != "shm":
                raise AdoptError(f"the stored arena is for transport {descriptor.get('kind')!r}, not shm")
            if len(fds) != 1:
                raise AdoptError(f"an shm arena is one memfd; the store returned {len(fds)} fds")
            if descriptor.get("size") != layout.total_bytes:
                raise AdoptError(f"the stored arena is described as {descriptor.get('size')} bytes; "
                                 f"its layout needs {layout.total_bytes}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        os.set_inheritable(fds[0], False)
        return ShmArena(layout, fd=fds[0])

    def prove(self, arena: Arena, checksums: Mapping[str, str]) -> Proof:
        """The memfd's seals and size: ``F_GET_SEALS`` must show
        write|shrink|grow|seal (so no byte changed since the depositor hashed
        them and sealed) and ``fstat`` the layout's size. ``checksums`` are
        not needed (:attr:`proof_needs_checksums` is False) and not read.
        Raises :class:`ArenaProofError` naming the missing seals or the size."""
        start = time.perf_counter()
        if not isinstance(arena, ShmArena) or arena.fd < 0:
            raise ArenaProofError(f"not an open shm arena: {type(arena).__name__}")
        try:
            seals = fcntl.fcntl(arena.fd, F_GET_SEALS)
        except OSError as exc:
            raise ArenaProofError(f"the stored fd is not a sealable memfd ({exc.strerror or exc})") from exc
        missing = seal_names(SEALS & ~seals)
        if missing:
            raise ArenaProofError(f"the stored memfd lacks seals {missing}: its bytes may have changed "
                                  "since they were hashed")
        size = os.fstat(arena.fd).st_size
        if size != arena.layout.total_bytes:
            raise ArenaProofError(f"the stored memfd holds {size} bytes; its layout needs "
                                  f"{arena.layout.total_bytes}")
        return Proof("seals", len(arena.layout.entries), size, time.perf_counter() - start)

    def attach(self, descriptor: dict[str, Any], fds: list[int], layout: Layout, *,
               writable: bool = True) -> ShmAttachment:
        """Map the daemon's sealed memfd privately and return typed views.

        ``writable`` changes nothing here: the seal and ``MAP_PRIVATE``
        already keep every write in the engine's own pages.

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
            mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
        base = _buffer_tensor(mapping)
        return ShmAttachment(mapping, {e.name: view(base, e) for e in layout.entries})
