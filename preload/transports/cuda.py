"""CUDA transport: one device allocation per rank, exported as one IPC handle.

The daemon allocates a single ``uint8`` tensor of ``layout.total_bytes`` on
its GPU and every tensor of the rank is a typed view at an aligned offset.
An engine opens that one handle and rebuilds the views itself: opening one
handle is a single ``cudaIpcOpenMemHandle`` (an H200 probe: one arena plus
300 views 4.0 ms, 300 separate handles 40.6 ms).

The handle travels as JSON. ``UntypedStorage._share_cuda_()`` returns an
8-tuple ``(device, handle, size, offset, ref_counter_handle,
ref_counter_offset, event_handle, event_sync_required)``; its byte strings
go out as base64 (msgspec's JSON form of ``bytes``: the handle and the
descriptor are msgspec Structs, so their shape is checked by msgspec) and ``UntypedStorage._new_shared_cuda(...)`` rebuilds the
storage on the other side. No pickle: ``torch.multiprocessing`` would
serialise the same tuple with pickle, and a peer that can make us unpickle
can make us run code.

Reference counting follows torch's own IPC protocol: every
``_share_cuda_()`` call puts the storage behind a fresh shared-memory
counter set to 1, and the engine's storage decrements it when it is freed.
So the daemon shares once per engine (each ``descriptor()`` call), and when
it releases the arena while an engine still maps it, torch keeps the block
alive ("limbo") until that engine lets go, instead of freeing memory under
it.

Device memory cannot be sealed the way a memfd can: ``seal()`` ends the
daemon's own writes (its views are dropped), but a zero-copy engine *can*
write into the daemon's weights through its mapping (``engines_can_write``).
``preload.checksum`` detects that on the next attach (``verify_resident``).

The descriptor names the GPU by UUID, not index: ``CUDA_VISIBLE_DEVICES``
renumbers devices per process, and an engine must map the arena of the
daemon on *its own* GPU.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, get_args

import msgspec
import torch

from pgbase.errors import WeightCacheUnavailableError
from preload.transports.base import Arena, Attachment, Layout, Transport, view

ARENA = "arena"
PER_TENSOR = "per_tensor"
Mode = Literal["arena", "per_tensor"]
MODES: tuple[str, ...] = get_args(Mode)
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


def device_uuid(index: int) -> str:
    """The stable identity of local CUDA device ``index`` (``GPU-...`` form)."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def local_index(uuid: str) -> int | None:
    """This process's index for the GPU called ``uuid``; None if it cannot see it."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


class IpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The JSON form of one ``_share_cuda_()`` tuple (bytes as base64)."""

    handle: bytes
    storage_size: _NonNegative
    storage_offset: _NonNegative
    ref_counter: bytes
    ref_counter_offset: _NonNegative
    event: bytes
    event_sync_required: bool

    @classmethod
    def share(cls, storage: torch.UntypedStorage) -> IpcHandle:
        """Export ``storage``; each call is one more consumer reference."""
        shared = storage._share_cuda_()
        if len(shared) != 8:
            raise RuntimeError(
                f"torch {torch.__version__}: _share_cuda_() returned {len(shared)} fields, "
                "expected 8; the CUDA transport needs updating for this torch"
            )
        _dev, handle, size, offset, rc, rc_offset, event, sync = shared
        return cls(
            handle=bytes(handle), storage_size=int(size), storage_offset=int(offset),
            ref_counter=bytes(rc), ref_counter_offset=int(rc_offset),
            event=bytes(event) if event is not None else b"",
            event_sync_required=bool(sync),
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, obj: Any) -> IpcHandle:
        """Parse a handle from the wire; WeightCacheUnavailableError names
        what is malformed (msgspec's path: ``$.storage_offset``)."""
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise WeightCacheUnavailableError(f"cuda descriptor: bad handle: {exc}") from exc

    def open(self, device: int) -> torch.UntypedStorage:
        """Map the exporter's memory in this process (never in the exporter itself)."""
        torch.cuda._lazy_init()
        with torch.cuda.device(device):
            return torch.UntypedStorage._new_shared_cuda(
                device, self.handle, self.storage_size, self.storage_offset,
                self.ref_counter, self.ref_counter_offset, self.event, self.event_sync_required,
            )


class _Descriptor(msgspec.Struct):
    """What ``CudaArena.descriptor()`` sends; other fields (``device_index``,
    ``pid``) are for people reading a frame and are not checked."""

    kind: str
    mode: Mode
    gpu_uuid: Annotated[str, msgspec.Meta(min_length=1)]
    size: int
    handles: list[IpcHandle]


def parse_descriptor(descriptor: Any, layout: Layout) -> tuple[str, str, list[IpcHandle]]:
    """Check a descriptor against the layout; returns (mode, gpu_uuid, handles).

    Pure JSON work (no CUDA), so it is unit-tested on machines without a GPU.
    Raises WeightCacheUnavailableError naming the field (msgspec's path) or
    the size that does not fit the layout.
    """
    kind = descriptor.get("kind") if isinstance(descriptor, dict) else None
    if kind != "cuda":
        raise WeightCacheUnavailableError(f"descriptor is for transport {kind!r}, not cuda")
    try:
        d = msgspec.convert(descriptor, _Descriptor)
    except msgspec.ValidationError as exc:
        raise WeightCacheUnavailableError(f"cuda descriptor: {exc}") from exc
    mode, handles = d.mode, d.handles
    if d.size != layout.total_bytes:
        raise WeightCacheUnavailableError(
            f"cuda descriptor: arena of {d.size} bytes, the layout needs {layout.total_bytes}"
        )
    want = 1 if mode == ARENA else len(layout.entries)
    if len(handles) != want:
        raise WeightCacheUnavailableError(
            f"cuda descriptor: mode {mode} needs {want} handle(s), got {len(handles)}"
        )
    if mode == ARENA and handles[0].storage_size < layout.total_bytes:
        raise WeightCacheUnavailableError(
            f"cuda descriptor: the shared storage holds {handles[0].storage_size} bytes, "
            f"the layout needs {layout.total_bytes}"
        )
    if mode == PER_TENSOR:
        for entry, h in zip(layout.entries, handles, strict=True):
            if h.storage_size < entry.nbytes:
                raise WeightCacheUnavailableError(
                    f"cuda descriptor: tensor {entry.name} needs {entry.nbytes} bytes, "
                    f"its storage holds {h.storage_size}"
                )
    return mode, d.gpu_uuid, handles


def _flat(storage: torch.UntypedStorage, nbytes: int, device: int) -> torch.Tensor:
    base = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    return base.set_(storage, 0, (nbytes,), (1,))


class CudaArena(Arena):
    """Daemon side: the rank's tensors in one allocation (or one each, for comparison)."""

    # No write seal exists for device memory: a zero-copy engine can write
    # here, so the daemon checksums the tensors (preload.checksum.resident_checksums).
    engines_can_write = True

    def __init__(self, layout: Layout, device: int, mode: str = ARENA) -> None:
        if mode not in MODES:
            raise ValueError(f"cuda arena mode {mode!r} is not one of {MODES}")
        self.layout = layout
        self.device = device
        self.mode = mode
        self.uuid = device_uuid(device)
        dev = torch.device("cuda", device)
        self.base: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []
        if mode == ARENA:
            self.base = torch.empty(layout.total_bytes, dtype=torch.uint8, device=dev)
            self._views: dict[str, torch.Tensor] | None = {e.name: view(self.base, e) for e in layout.entries}
        else:
            self._parts = [torch.empty(max(e.nbytes, 1), dtype=torch.uint8, device=dev) for e in layout.entries]
            self._views = {
                e.name: p[: e.nbytes].view(_dtype(e.dtype)).view(e.shape)
                for e, p in zip(layout.entries, self._parts, strict=True)
            }
        self.sealed = False
        self.closed = False

    @property
    def gpu_uuid(self) -> str:
        return self.uuid

    def views(self) -> dict[str, torch.Tensor]:
        if self.closed:
            raise RuntimeError("the arena was closed")
        if self.sealed or self._views is None:
            raise RuntimeError("the arena is sealed; its views are gone")
        return self._views

    def seal(self) -> None:
        """Wait for every copy into the arena to land, then drop the writable
        views: nothing of the daemon's writes here again (``views()`` refuses).

        Engines still can (``engines_can_write``); the checksums taken
        before sealing (``preload.checksum``) stand in for a write seal.
        """
        if self.sealed:
            return
        torch.cuda.synchronize(self.device)
        self._views = None
        self.sealed = True

    def descriptor(self) -> dict[str, Any]:
        """A fresh export: call once per engine (each is one reference)."""
        if self.closed:
            raise RuntimeError("the arena was closed")
        if not self.sealed:
            raise RuntimeError("an unsealed arena must not be shared")
        storages = [self.base.untyped_storage()] if self.base is not None else [
            p.untyped_storage() for p in self._parts
        ]
        return {
            "kind": "cuda", "mode": self.mode, "size": self.layout.total_bytes,
            "gpu_uuid": self.uuid, "device_index": self.device, "pid": os.getpid(),
            "handles": [IpcHandle.share(s).to_json() for s in storages],
        }

    def close(self) -> None:
        """Free the memory; torch keeps it while an engine still maps it."""
        self._views = None
        self.base = None
        self._parts = []
        self.closed = True
        torch.cuda.synchronize(self.device)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class CudaAttachment(Attachment):
    """Engine side: typed views over the daemon's memory, mapped in this process."""

    def __init__(self, tensors: dict[str, torch.Tensor], base: torch.Tensor | None, device: int) -> None:
        self.tensors = tensors
        self.base = base
        self.device = device

    def close(self) -> None:
        """Drop our references; the mapping closes (and the daemon's counter
        drops) once no tensor, e.g. a model parameter, still uses it."""
        self.tensors = {}
        self.base = None
        torch.cuda.synchronize(self.device)


def _dtype(name: str) -> torch.dtype:
    from preload.transports.base import dtype_from_name

    return dtype_from_name(name)


class CudaTransport(Transport):
    """One IPC handle per rank; ``device`` is this process's GPU (default: current).

    >>> t = CudaTransport()                         # doctest: +SKIP
    >>> arena = t.create(layout); fill(arena.views()); arena.seal()
    >>> desc = arena.descriptor()                   # JSON, sent to the engine
    >>> att = CudaTransport().attach(desc, [], layout)   # in the engine process
    """

    name = "cuda"
    engines_can_write = CudaArena.engines_can_write

    def __init__(self, device: int | None = None, mode: str = ARENA) -> None:
        self._device = device
        self.mode = mode

    @property
    def device(self) -> int:
        return torch.cuda.current_device() if self._device is None else self._device

    def memory_device(self) -> str:
        return f"cuda:{self.device}"

    def create(self, layout: Layout) -> CudaArena:
        if not torch.cuda.is_available():
            raise WeightCacheUnavailableError("the cuda transport needs a CUDA device; none is visible")
        return CudaArena(layout, self.device, self.mode)

    def attach(self, descriptor: dict[str, Any], fds: list[int], layout: Layout) -> CudaAttachment:
        """Open the daemon's handle(s) on this engine's own GPU and build the views."""
        for fd in fds:  # the cuda transport passes none; never leak what came anyway
            os.close(fd)
        mode, uuid, handles = parse_descriptor(descriptor, layout)
        if not torch.cuda.is_available():
            raise WeightCacheUnavailableError("cannot attach a cuda arena: no CUDA device is visible")
        own = self.device
        own_uuid = device_uuid(own)
        if uuid != own_uuid:
            seen = local_index(uuid)
            where = f"this process's cuda:{seen}" if seen is not None else "a GPU this process cannot see"
            raise WeightCacheUnavailableError(
                f"the daemon's arena lives on {uuid} ({where}); this engine runs on "
                f"cuda:{own} ({own_uuid}); start the engine on the daemon's GPU or point it at that GPU's daemon"
            )
        try:
            if mode == ARENA:
                base = _flat(handles[0].open(own), layout.total_bytes, own)
                tensors = {e.name: view(base, e) for e in layout.entries}
                return CudaAttachment(tensors, base, own)
            tensors = {}
            for e, h in zip(layout.entries, handles, strict=True):
                flat = _flat(h.open(own), e.nbytes, own)
                tensors[e.name] = flat.view(_dtype(e.dtype)).view(e.shape)
            return CudaAttachment(tensors, None, own)
        except RuntimeError as exc:
            raise WeightCacheUnavailableError(f"cannot open the daemon's CUDA IPC handle: {exc}") from exc
