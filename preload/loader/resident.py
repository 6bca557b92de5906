"""Whether and how an engine checks the weights it attached are unchanged.

A CUDA arena has no write seal, so an earlier zero-copy engine may have
written into it; :mod:`preload.checksum` compares the attached tensors with
the checksums the daemon took after loading.
"""

from __future__ import annotations

from typing import Any

from preload.loader.options import LoaderOptions


def should_verify(opts: LoaderOptions, state: Any) -> bool:
    """``verify_resident`` as configured, else on for arenas an engine can
    write into (CUDA: zero-copy maps the daemon's own memory); a sealed shm
    arena is copy-on-write and needs no check."""
    if opts.verify_resident is not None:
        return opts.verify_resident
    return state.descriptor.get("kind") != "shm"


def verify_attached(tensors: dict[str, Any], state: Any) -> None:
    """Check attached tensors against the daemon's resident checksums.

    A sealed shm arena cannot change (attach verified the seals), so it
    carries no checksums and passes; a CUDA arena must carry one per tensor.
    """
    if not state.checksums and state.descriptor.get("kind") == "shm":
        return
    from preload.checksum import verify_resident

    verify_resident(tensors, state.layout, state.checksums)

