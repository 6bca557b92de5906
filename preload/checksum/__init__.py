"""Resident-weight checksums: did anything write into the daemon's weights?

A CUDA arena has no write seal, so the daemon checksums each tensor once
after loading (:func:`resident_checksums`) and an engine checks what it
attached against those (:func:`verify_resident`) before trusting it.

>>> verify_resident(attachment.tensors, state.layout, state.checksums)  # doctest: +SKIP

Modules, one concern each: :mod:`~preload.checksum.scheme` (the definition
of the three lanes), :mod:`~preload.checksum.reference` (the torch path,
CPU and CI), :mod:`~preload.checksum.planner` and
:mod:`~preload.checksum.kernel` (one Triton launch over a CUDA arena),
:mod:`~preload.checksum.resident` (arena-wide checksums and the check).
"""

from __future__ import annotations

from preload.checksum.planner import SHAPE_ENV, ChecksumSettingsError, KernelShape, warm
from preload.checksum.reference import tensor_checksum
from preload.checksum.resident import (
    ResidentWeightsChangedError,
    VerifyReport,
    arena_base,
    arena_checksums,
    changed_tensors,
    checksum_tensors,
    resident_checksums,
    verify_resident,
)
from preload.checksum.scheme import BLOCK_WORDS, SCHEME, Checksum

__all__ = [
    "BLOCK_WORDS",
    "SCHEME",
    "SHAPE_ENV",
    "Checksum",
    "ChecksumSettingsError",
    "KernelShape",
    "ResidentWeightsChangedError",
    "VerifyReport",
    "arena_base",
    "arena_checksums",
    "changed_tensors",
    "checksum_tensors",
    "resident_checksums",
    "tensor_checksum",
    "verify_resident",
    "warm",
]
