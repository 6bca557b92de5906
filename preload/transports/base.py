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
- across daemons (issue 26): a sealed arena's ``deposit()`` gives what an fd
  store keeps (a JSON-able descriptor and fresh fds); a successor daemon's
  ``adopt(descriptor, fds, layout)`` turns them back into a sealed arena
  without reading the checkpoint, and serves it only after ``prove(arena,
  checksums)`` passed. ``proof_needs_checksums`` says whether that proof
  needs the resident checksums recorded when the bytes were hashed (cuda:
  an engine may have written into them) or stands on the arena alone (shm:
  its write seal). The store, the record and the events are the daemon's
  (:mod:`preload.daemon.adopt`); a transport knows only bytes and fds.

All tensors of a rank live in one arena at aligned offsets: one handle to
open instead of one per tensor.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from pgbase import dtypes
from pgbase.errors import PreloadGateError

ALIGN = 256

def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name on the wire (``"float8_e8m0fnu"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a wire name stands for: any dtype safetensors and the
    installed torch share (:mod:`pgbase.dtypes`, built from their own
    tables). ValueError naming the dtype, the versions and the known names."""
    return dtypes.by_name(name).torch


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
        """Place ``(name, dtype, shape, kind)`` specs at ``align``-byte offsets.

        ``shape`` is the torch tensor's (a packed dtype's last dimension
        already divided); bytes per element are torch's ``dtype.itemsize``.
        """
        entries, cursor = [], 0
        for name, dtype, shape, kind in specs:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
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


class AdoptError(PreloadGateError):
    """The fd store's descriptor and fds cannot be taken over as an arena of
    this transport at this layout (wrong kind, fd count, size; a transport
    whose arenas cannot outlive their daemon). The message names what."""


class ArenaProofError(PreloadGateError):
    """An adopted arena is not provably the bytes its depositor hashed: a
    seal missing, a size that differs, a resident checksum that differs or
    is absent. The message names what (and, for checksums, which tensors);
    the daemon adds the rank, drops the arena and loads from disk."""


@dataclass(frozen=True)
class Proof:
    """What a passed ``Transport.prove`` checked: ``method`` is ``"seals"``
    (shm) or ``"checksum"`` (cuda), over ``tensors`` entries and ``bytes``
    bytes, in ``seconds``."""

    method: str
    tensors: int
    bytes: int
    seconds: float


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

    # True for an arena made by ``Transport.adopt`` (taken over from an fd
    # store), False for one this process filled.
    adopted: bool = False

    def deposit(self) -> tuple[dict[str, Any], list[int]]:
        """What an fd store keeps so a successor can ``adopt`` this arena:
        a JSON-able descriptor (no pickles; ``descriptor()``'s shape or the
        transport's own) and fresh file descriptors the caller owns and must
        close. Only a sealed arena is deposited (RuntimeError otherwise).

        The default raises :class:`AdoptError`: a transport whose memory
        dies with its process (the legacy CUDA IPC arena) cannot outlive
        its daemon, and the daemon then deposits nothing.
        """
        raise AdoptError(f"{type(self).__name__} cannot outlive its daemon (no deposit)")

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
    def attach(self, descriptor: dict[str, Any], fds: list[int], layout: Layout, *,
               writable: bool = True) -> Attachment:
        """Map the arena in this (engine) process. ``writable=False``: the
        caller never writes through the tensors, so a transport that can map
        read-only does (cuda: ``PROT_READ``), and a stray write faults
        instead of reaching the daemon's bytes."""

    @property
    def proof_needs_checksums(self) -> bool:
        """Whether ``prove`` needs the resident checksums recorded when the
        bytes were hashed. True where engines can write into an arena (no
        seal to stand on: the bytes must be summed again), False where the
        arena itself proves it is unchanged (a sealed memfd). A daemon never
        adopts an arena that needs checksums from a record that has none."""
        return self.engines_can_write

    def adopt(self, descriptor: dict[str, Any], fds: list[int], layout: Layout) -> Arena:
        """Daemon side of a takeover: the arena an earlier daemon deposited
        (``Arena.deposit()``), from the fd store's descriptor and fds, as a
        SEALED arena (``views()`` refuses; ``descriptor()``/``fds()`` serve
        engines as a freshly loaded one does; ``adopted`` is True).

        Takes ownership of ``fds``: kept by the arena, or closed here when
        it raises. Checks the shape only (kind, fd count, size against
        ``layout``) and raises :class:`AdoptError` naming what differs;
        whether the bytes are the hashed ones is ``prove``'s question, asked
        before the arena serves. No checkpoint byte is read. The default
        raises :class:`AdoptError` (the transport cannot adopt).
        """
        for fd in fds:
            _close_quietly(fd)
        raise AdoptError(f"transport {self.name} cannot adopt an arena")

    def prove(self, arena: Arena, checksums: Mapping[str, str]) -> Proof:
        """Prove an adopted ``arena`` holds the bytes its depositor hashed,
        or raise :class:`ArenaProofError` naming what failed.

        ``checksums`` are the resident checksums recorded with the arena
        (``preload.checksum``, one per layout entry; ``{}`` when none were
        taken). Where ``proof_needs_checksums`` is True the proof recomputes
        them over the arena and an absent one is a failure, not a pass;
        where it is False they are ignored. Costs no checkpoint I/O.
        """
        raise ArenaProofError(f"transport {self.name} has no proof for adopted arenas")


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
