"""Transports: how a rank's tensors travel from a daemon to an engine.

``get_transport(name)`` is the one place that maps a name (``shm``,
``cuda``) to an implementation; everything above asks for a name and uses
the interface in :mod:`preload.transports.base`.
"""

from __future__ import annotations

import importlib

from preload.transports.base import Transport

_IMPLEMENTATIONS = {
    "shm": ("preload.transports.shm", "ShmTransport"),
    "cuda": ("preload.transports.cuda", "CudaTransport"),
}
NAMES = tuple(_IMPLEMENTATIONS)


def get_transport(name: str) -> Transport:
    """The transport called ``name``; imported lazily (cuda needs CUDA)."""
    try:
        module, cls = _IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r} (known: {', '.join(NAMES)})") from None
    return getattr(importlib.import_module(module), cls)()
