"""preload: content-keyed weight preloading for vLLM.

The public face is small: ``promote`` (hash a checkpoint and record its
manifest), ``fingerprints`` (compare two checkpoints under every anchor
scheme). The daemon and loader are reached through ``preload-gate preload``
and ``--load-format verified_cache``.

The names are resolved on first use (PEP 562): importing a submodule such as
``preload.client`` inside an engine must not import promotion and every
anchor scheme with it (they are the promoter's, not the loader's).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preload.identity.anchors import fingerprints
    from preload.promote import Promotion, promote

__all__ = ["Promotion", "fingerprints", "promote"]

_HOMES = {"Promotion": "preload.promote", "promote": "preload.promote", "fingerprints": "preload.identity.anchors"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'preload' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
