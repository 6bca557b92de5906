"""What a stage hands the server: a sealed arena and the proof behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

from preload.identity.key import WeightCacheKey
from preload.transports.base import Arena, Layout


@dataclass
class Filled:
    """One rank's weights, sealed in ``arena`` at ``layout``.

    ``digest`` is the checkpoint digest of the bytes actually read (or, under
    the unsafe header-only control, the header digest); ``aliases`` maps a
    tied name to the canonical entry it shares storage with.
    """

    arena: Arena
    layout: Layout
    key: WeightCacheKey
    digest: str
    stage: str
    aliases: dict[str, str] = field(default_factory=dict)
    shard_digests: dict[str, str] = field(default_factory=dict)
    # Per-tensor resident checksums (preload.checksum) for arenas engines can write.
    checksums: dict[str, str] = field(default_factory=dict)
    load_seconds: float = 0.0
    bytes_read: int = 0
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0
