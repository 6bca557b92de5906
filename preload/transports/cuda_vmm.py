"""CUDA virtual memory through cuda-python's driver bindings: the arena's allocation.

One arena is one physical allocation made with ``cuMemCreate`` (pinned
device memory on one GPU, requested handle type
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), its size rounded up to
``cuMemGetAllocationGranularity`` (the driver refuses any other size).
``cuMemExportToShareableHandle`` turns it into a plain file descriptor: it
travels over ``SCM_RIGHTS`` like a memfd, and the allocation lives while any
process holds such an fd, an imported handle or a mapping (the probe in
``shared/probes`` and ``tests/gpu/test_gpu_vmm.py`` show a process with no
CUDA context holding only the fd keeps it alive). That is what lets an
arena outlive the daemon that made it; torch's ``cudaIpc`` handles die with
their exporter.

A process maps an allocation with ``cuMemAddressReserve`` + ``cuMemMap`` +
``cuMemSetAccess`` (:class:`Mapping`) and sees it as a torch tensor through
``__cuda_array_interface__`` (:func:`tensor_over`): torch wraps the pointer
(no copy: checked by pointer equality) and holds the mapping alive while
any tensor over it lives. Access is ``PROT_READ`` where the caller needs no
writes and the driver grants it, else read-write (:attr:`Mapping.access`
says which it got).

Imports neither the bindings nor the driver until first use, so the tree
imports on machines without CUDA; every driver failure is a
:class:`CudaDriverError` naming the call and the driver's error name.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from pgbase.errors import WeightCacheUnavailableError

READ = "read"
READWRITE = "readwrite"

_lock = threading.Lock()
_driver: Any = None
_contexts: dict[int, Any] = {}
_granularity: dict[int, int] = {}


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed: ``call`` and the driver's ``error_name``."""

    def __init__(self, call: str, code: int, error_name: str) -> None:
        self.call, self.code, self.error_name = call, code, error_name
        super().__init__(f"{call} failed: {error_name} ({code})")


def driver() -> Any:
    """``cuda.bindings.driver``, initialised; WeightCacheUnavailableError
    naming the package when the bindings are not installed."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                try:
                    from cuda.bindings import driver as d
                except ImportError as exc:
                    raise WeightCacheUnavailableError(
                        "the cuda transport needs cuda-python's driver bindings: "
                        "pip install 'preload-gate[gpu]' (or cuda-bindings)"
                    ) from exc
                _check(d, "cuInit", d.cuInit(0))
                _driver = d
    return _driver


def _check(d: Any, name: str, result: Any) -> Any:
    err = result[0]
    if int(err) != 0:
        got = d.cuGetErrorName(err)
        label = got[1].decode() if int(got[0]) == 0 and isinstance(got[1], bytes) else str(err)
        raise CudaDriverError(name, int(err), label)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def call(name: str, *args: Any) -> Any:
    """``driver().<name>(*args)``: its result, or CudaDriverError."""
    d = driver()
    return _check(d, name, getattr(d, name)(*args))


def bind(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context (the one torch uses) current
    in this thread: driver calls act on the current context, and a server or
    finaliser thread may have none."""
    ctx = _contexts.get(ordinal)
    if ctx is None:
        ctx = _contexts.setdefault(ordinal, call("cuDevicePrimaryCtxRetain", call("cuDeviceGet", ordinal)))
    current = call("cuCtxGetCurrent")
    if current is None or int(current) != int(ctx):
        call("cuCtxSetCurrent", ctx)


def _prop(ordinal: int) -> Any:
    d = driver()
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = ordinal
    p.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def granularity(ordinal: int) -> int:
    """The driver's minimum allocation granularity on device ``ordinal`` (bytes;
    2 MiB on an H200): sizes and reservations are multiples of it."""
    g = _granularity.get(ordinal)
    if g is None:
        d = driver()
        g = int(call("cuMemGetAllocationGranularity", _prop(ordinal),
                     d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        _granularity[ordinal] = g
    return g


def rounded(nbytes: int, gran: int) -> int:
    """``nbytes`` rounded up to a multiple of ``gran`` (at least one granule)."""
    return max(1, -(-nbytes // gran)) * gran


def _fd_type() -> Any:
    return driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def create(ordinal: int, size: int) -> Any:
    """A new physical allocation of ``size`` bytes (a granularity multiple) on
    device ``ordinal``, exportable as a POSIX fd; the caller releases it."""
    bind(ordinal)
    return call("cuMemCreate", size, _prop(ordinal), 0)


def export_fd(handle: Any) -> int:
    """A new file descriptor for ``handle``'s allocation (the caller owns it)."""
    return int(call("cuMemExportToShareableHandle", handle, _fd_type(), 0))


def import_fd(fd: int, ordinal: int) -> Any:
    """The allocation behind ``fd`` as a handle of this process (the fd stays
    the caller's); CudaDriverError when ``fd`` is no CUDA allocation."""
    bind(ordinal)
    return call("cuMemImportFromShareableHandle", fd, _fd_type())


def release(handle: Any) -> None:
    call("cuMemRelease", handle)


def allocation_device(handle: Any) -> int:
    """The device ordinal an allocation's memory sits on (its creation property)."""
    return int(call("cuMemGetAllocationPropertiesFromHandle", handle).location.id)


class Mapping:
    """One allocation mapped at ``ptr`` in this process, ``size`` bytes.

    The mapping holds its own reference to the allocation: the handle it was
    made from may be released right after. ``close()`` (or the last tensor
    over it going away) unmaps and frees the address range.
    """

    def __init__(self, handle: Any, size: int, ordinal: int, writable: bool) -> None:
        self.size, self.ordinal = size, ordinal
        bind(ordinal)
        self._va = call("cuMemAddressReserve", size, granularity(ordinal), 0, 0)
        self._mapped = False
        try:
            call("cuMemMap", self._va, size, 0, handle, 0)
            self._mapped = True
            self.access = ""
            self.protect(writable)
        except BaseException:
            self.close()
            raise
        self.ptr = int(self._va)
        self._pid = os.getpid()

    def protect(self, writable: bool) -> str:
        """Set this device's access: ``PROT_READ`` when not ``writable`` and the
        driver grants it, else read-write. Returns (and keeps in ``access``)
        what was set; ``read_only_refused`` names the driver's answer when
        read-only was asked for and refused."""
        d = driver()
        flags = d.CUmemAccess_flags
        self.read_only_refused: str | None = None
        if not writable:
            try:
                self._set(flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
                self.access = READ
                return self.access
            except CudaDriverError as exc:
                self.read_only_refused = exc.error_name
        self._set(flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self.access = READWRITE
        return self.access

    def _set(self, flag: Any) -> None:
        d = driver()
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.ordinal
        desc.flags = flag
        call("cuMemSetAccess", self._va, self.size, [desc], 1)

    def close(self) -> None:
        va, self._va = getattr(self, "_va", None), None
        if va is None or getattr(self, "_pid", os.getpid()) != os.getpid():
            return  # a forked child inherits no CUDA mappings; nothing to undo there
        try:
            bind(self.ordinal)
            if self._mapped:
                call("cuMemUnmap", va, self.size)
                self._mapped = False
            call("cuMemAddressFree", va, self.size)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
            pass

    def __del__(self) -> None:
        self.close()


class _Buffer:
    """The ``__cuda_array_interface__`` of a mapping; torch holds this object,
    hence the mapping, for as long as any tensor over it lives."""

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (mapping.size,), "typestr": "|u1", "data": (mapping.ptr, False),
            "strides": None, "version": 2,
        }


def tensor_over(mapping: Mapping) -> torch.Tensor:
    """A flat ``uint8`` CUDA tensor over the whole mapping, without a copy.

    RuntimeError when torch did copy (its pointer is not the mapping's) or
    placed it on another device: a silent copy would defeat zero-copy and
    hide writes from the checksums.
    """
    t = torch.as_tensor(_Buffer(mapping))
    if t.data_ptr() != mapping.ptr or t.device != torch.device("cuda", mapping.ordinal):
        raise RuntimeError(
            f"torch wrapped the mapping at {mapping.ptr:#x} on cuda:{mapping.ordinal} as "
            f"{t.data_ptr():#x} on {t.device}: not the same memory"
        )
    return t
