"""Whether and how an engine checks the weights it attached are unchanged.

Where the transport says engines can write into the daemon's arena
(``Transport.engines_can_write``: a CUDA arena has no write seal), an
earlier zero-copy engine may have; :mod:`preload.checksum` compares the
attached tensors with the checksums the daemon took after loading.
"""

from __future__ import annotations

from typing import Any

from preload.loader.options import LoaderOptions
from preload.transports import transport_for


def should_verify(opts: LoaderOptions, state: Any) -> bool:
    """``verify_resident`` as configured, else on for arenas an engine can
    write into (CUDA: zero-copy maps the daemon's own memory); a sealed shm
    arena is copy-on-write and needs no check."""
    if opts.verify_resident is not None:
        return opts.verify_resident
    return transport_for(state.descriptor).engines_can_write


def verify_attached(tensors: dict[str, Any], state: Any) -> None:
    """Check attached tensors against the daemon's resident checksums.

    An arena engines cannot write (a sealed shm memfd: attach verified the
    seals) carries no checksums and passes; one they can (CUDA) must carry
    one per tensor.
    """
    if not state.checksums and not transport_for(state.descriptor).engines_can_write:
        return
    from preload.checksum import verify_resident

    verify_resident(tensors, state.layout, state.checksums)

