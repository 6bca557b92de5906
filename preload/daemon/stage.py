"""A stage's contract: what it is asked to fill (:class:`RankConfig`), what it
hands the server (:class:`Filled`: a sealed arena and the proof behind it)
and the memory figures it reports (:func:`rss_bytes`, :func:`peak_rss_bytes`).

The rank process (:mod:`preload.daemon.rank`) and the stages it runs
(:mod:`~preload.daemon.raw`, :mod:`~preload.daemon.loaded`) both import
this module, so neither imports the other's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from pgbase.errors import PreloadGateError
from pgbase.json_shape import convert
from pgbase.limits import gib
from pgbase.oscause import describe
from preload.daemon.settings import DaemonSettings
from preload.identity.key import WeightCacheKey
from preload.transports.base import Arena, Layout, Transport


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
    # "disk": filled by reading the checkpoint; "adopted": taken over from the
    # fd store (preload.daemon.adopt), +1 generation per adoption, proven in
    # ``adopt_seconds`` (fetch, adopt, prove; no checkpoint byte read).
    origin: str = "disk"
    generation: int = 0
    adopt_seconds: float = 0.0
    # CUDA: device bytes the fill left this process holding (free memory
    # before building the model minus free memory once sealed), and what
    # torch's caching allocator gave back after the copy into the arena.
    device_bytes_held: int = 0
    device_cache_returned: int = 0


@dataclass
class RankConfig(DaemonSettings):
    """One rank's orders from the launcher, sent as JSON on the rank's stdin:
    the verb's daemon settings, the rank's place and the digest to prove."""

    global_rank: int = 0
    local_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    expected_digest: str | None = None
    distributed_init_method: str | None = None
    cpus: list[int] | None = None

    @classmethod
    def from_json(cls, obj: Any) -> RankConfig:
        """The launcher's orders; ValueError, one line naming the field
        (:func:`pgbase.json_shape.convert`: an unknown field by name, a
        wrong type by msgspec's path, e.g. ``$.tp_rank``)."""
        return convert(obj, cls, "rank config")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def create_arena(transport: Transport, layout: Layout) -> Arena:
    """``transport.create(layout)``; an arena the system cannot give (no
    memory, no descriptor) is a PreloadGateError naming the cause and the size."""
    try:
        return transport.create(layout)
    except OSError as exc:
        raise PreloadGateError(f"cannot create the {gib(layout.total_bytes)} arena: {describe(exc)}") from exc


def rss_bytes() -> int:
    """This process's resident set now, in bytes (VmRSS, through psutil)."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident set, in bytes (VmHWM of /proc/self/status,
    proc(5)); 0 if absent. Read by hand: psutil has no peak, and
    ``getrusage``'s ``ru_maxrss`` is not it (it keeps the peak of the image
    before exec, the forked parent's)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
