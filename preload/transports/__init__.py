"""Transports: how a rank's tensors travel from a daemon to an engine.

``get_transport(name)`` is the one place that maps a name (``shm``,
``cuda``) to an implementation, and ``transport_for(descriptor)`` the one
place that reads which transport a daemon's descriptor names; everything
above uses the interface in :mod:`preload.transports.base` and never
compares transport names itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

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


def transport_for(descriptor: Mapping[str, Any]) -> Transport:
    """The transport that can attach ``descriptor`` (the daemon's
    ``Arena.descriptor()``); ValueError when it names none we know."""
    return get_transport(str(descriptor.get("kind")))
