"""The transport cut: how one rank's tensors get from a daemon to an engine.

A transport knows bytes and where they live (a sealed memfd, a CUDA
allocation); it knows nothing of vLLM, keys or sockets. Everything above it
sees only this interface and never asks which transport it has:

- daemon side: ``create(layout)`` returns an :class:`Arena` whose
  ``views()`` are filled in place (so weights are never held twice), then
  ``seal()`` ends every write through the arena and ``descriptor()``/``fds()``
  describe it for the wire (JSON-able, plus file descriptors for SCM_RIGHTS).
- engine side: ``attach(descriptor, fds, layout)`` maps it and returns an
  :class:`Attachment` of tensors, one per layout entry;
  :func:`preload.transports.transport_for` names the transport a
  descriptor came from.
- both sides: ``engines_can_write`` says whether an engine that attached
  zero-copy can change the daemon's bytes. Where it can, the daemon takes
  resident checksums before sealing and engines verify them after attaching
  (:mod:`preload.checksum`); where it cannot, there is nothing to verify.

All tensors of a rank live in one arena at aligned offsets: one handle to
open instead of one per tensor.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

ALIGN = 256

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


@dataclass(frozen=True)
class Entry:
    """One tensor's place in an arena. ``kind`` is "param" or "buffer"."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str = "param"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "offset": self.offset, "nbytes": self.nbytes, "kind": self.kind,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Entry:
        """One entry from the wire; ValueError names the field (msgspec's
        path, e.g. ``$.shape[1]``). Unknown fields are ignored."""
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"layout entry: {exc}") from exc


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    total_bytes: int

    @classmethod
    def plan(cls, specs: list[tuple[str, torch.dtype, tuple[int, ...], str]], align: int = ALIGN) -> Layout:
        """Place ``(name, dtype, shape, kind)`` specs at ``align``-byte offsets."""
        entries, cursor = [], 0
        for name, dtype, shape, kind in specs:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            entries.append(Entry(name, dtype_name(dtype), tuple(shape), cursor, nbytes, kind))
            cursor += -(-nbytes // align) * align
        return cls(tuple(entries), max(cursor, align))

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries]

    @classmethod
    def from_json(cls, items: Any, total_bytes: int) -> Layout:
        """The daemon's ``entries`` list against its ``total_bytes``; a
        ValueError names the entry that is malformed or outside the arena."""
        try:
            entries = msgspec.convert(items, tuple[Entry, ...])
        except msgspec.ValidationError as exc:
            raise ValueError(f"layout entries: {exc}") from exc
        for e in entries:
            if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > total_bytes:
                raise ValueError(f"entry {e.name} lies outside the arena")
        return cls(entries, total_bytes)


def view(base: torch.Tensor, entry: Entry) -> torch.Tensor:
    """A typed, shaped view of ``entry`` inside a flat uint8 arena tensor."""
    raw = base[entry.offset : entry.offset + entry.nbytes]
    return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)


class Arena(abc.ABC):
    """Daemon side: one rank's tensors in one allocation."""

    layout: Layout

    @property
    @abc.abstractmethod
    def engines_can_write(self) -> bool:
        """Whether an engine attached zero-copy can change these bytes after ``seal()``."""

    @property
    def gpu_uuid(self) -> str | None:
        """The GPU the bytes live on (``GPU-...``), None for host memory."""
        return None

    @abc.abstractmethod
    def views(self) -> dict[str, torch.Tensor]:
        """Writable views, one per entry; after ``seal()`` a RuntimeError."""

    @abc.abstractmethod
    def seal(self) -> None:
        """End every write through this arena: what the views wrote has landed,
        and ``views()`` refuses from now on. Whether other processes can still
        write is ``engines_can_write``."""

    @abc.abstractmethod
    def descriptor(self) -> dict[str, Any]:
        """JSON-able description an engine needs to attach (no pickles)."""

    def fds(self) -> list[int]:
        """File descriptors to pass with the descriptor (SCM_RIGHTS)."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Free the arena's memory (engines that attached keep their mapping)."""


class Attachment(abc.ABC):
    """Engine side: the mapped tensors of one rank."""

    tensors: dict[str, torch.Tensor]

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """One way to carry a rank's arena from a daemon to an engine."""

    name: str

    @property
    @abc.abstractmethod
    def engines_can_write(self) -> bool:
        """Whether an engine attached zero-copy can change the daemon's bytes
        (then the engine verifies the resident checksums the daemon sent)."""

    @abc.abstractmethod
    def create(self, layout: Layout) -> Arena: ...

    def memory_device(self) -> str:
        """Where an arena's bytes are resident, as :func:`preload.budget.memory_budget`
        names it (``"cpu"``, ``"cuda:N"``): what a load checks its size against."""
        return "cpu"

    @abc.abstractmethod
    def attach(self, descriptor: dict[str, Any], fds: list[int], layout: Layout) -> Attachment: ...
