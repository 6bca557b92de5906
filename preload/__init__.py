"""preload: content-keyed weight preloading for vLLM.

The public face is small: ``promote`` (hash a checkpoint and record its
manifest), ``fingerprints`` (compare two checkpoints under every anchor
scheme). The daemon and loader are reached through ``preload-gate preload``
and ``--load-format verified_cache``.
"""

from __future__ import annotations

from preload.identity.anchors import fingerprints
from preload.promote import Promotion, promote

__all__ = ["Promotion", "fingerprints", "promote"]
