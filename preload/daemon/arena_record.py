"""What an fd store keeps beside one rank's arena fds: the :class:`ArenaRecord`.

A daemon deposits its sealed arena (``Arena.deposit()``: a descriptor and
fds) with the facts a successor needs to take it over without reading the
checkpoint, and to prove it before serving: the digest it proved by hashing
every byte, the key it served, the layout engines attach by, and the
resident checksums it took from the bytes it hashed (cuda; ``{}`` for a
sealed memfd). The record is JSON (msgspec), never a pickle, and small: no
tensor bytes, at most :data:`MAX_RECORD_BYTES` on the wire.

Imports neither torch nor CUDA: the keeper (:mod:`preload.daemon.keeper`)
parses records and holds fds, nothing else. The layout stays JSON here;
the daemon turns it into a :class:`preload.transports.base.Layout`
(``Layout.from_json``, which checks every entry lies inside the arena).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

MAX_FDS_PER_RECORD = 16  # preload.protocol.MAX_FDS: one frame carries them all
MAX_RECORD_BYTES = 16 << 20
MAX_ARENAS = 64  # arenas one fd store holds (preload.daemon.fdstore.MAX_ARENAS; defined here for the keeper)

_Hex64 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Fds = Annotated[int, msgspec.Meta(ge=1, le=MAX_FDS_PER_RECORD)]

ORIGINS = ("disk", "adopted")


class ArenaRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's deposited arena, as the store keeps it (its fds beside it).

    - ``digest``: the checkpoint digest the depositor proved (64 lower-case hex).
    - ``global_rank``: the rank's socket number (``rank<N>.sock``).
    - ``key``: ``WeightCacheKey.to_json()`` of what it served; a successor
      adopts only when its own key has no field that differs.
    - ``stage``, ``transport``: ``raw|loaded|processed``, ``shm|cuda``.
    - ``descriptor``, ``nfds``: ``Arena.deposit()``'s descriptor and how many
      fds ride with it (the store refuses a deposit whose count differs).
    - ``entries``, ``total_bytes``, ``aliases``: the layout engines attach by.
    - ``shard_digests``: per-shard sha256 of the bytes hashed.
    - ``checksums``, ``checksum_scheme``: resident checksums taken from the
      hashed bytes (``preload.checksum``; ``{}`` and ``""`` where the
      transport's proof needs none), carried on from adoption to adoption.
    - ``checkpoint``: the checkpoint's real path (for ``status``).
    - ``daemon_id``, ``pid``, ``deposited_at`` (unix seconds): the depositor.
    - ``origin``: ``disk`` (the depositor read the checkpoint) or
      ``adopted``; ``generation``: 0 when read from disk, +1 per adoption.
    - ``load_seconds``, ``bytes_read``: what the read from disk cost.
    - ``orphan_ttl_s``: how long the store keeps the arena once no daemon
      holds it (0: until ``preload-gate stop``).
    """

    digest: _Hex64
    global_rank: _NonNegative
    key: dict[str, Any]
    stage: _Name
    transport: _Name
    descriptor: dict[str, Any]
    nfds: _Fds
    entries: list[dict[str, Any]]
    total_bytes: _NonNegative
    daemon_id: _Name
    pid: _NonNegative
    deposited_at: float
    aliases: dict[str, str] = {}
    shard_digests: dict[str, str] = {}
    checksums: dict[str, str] = {}
    checksum_scheme: str = ""
    checkpoint: str = ""
    origin: str = "disk"
    generation: _NonNegative = 0
    load_seconds: float = 0.0
    bytes_read: _NonNegative = 0
    orphan_ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 3600.0

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, obj: Any) -> ArenaRecord:
        """A record from the wire or a stored fd; ValueError naming the field
        (msgspec's path, e.g. ``$.global_rank``)."""
        try:
            rec = msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"arena record: {exc}") from exc
        if rec.origin not in ORIGINS:
            raise ValueError(f"arena record: origin {rec.origin!r} is not one of {ORIGINS}")
        if rec.key.get("content_digest") != rec.digest:
            raise ValueError("arena record: its key's content_digest is not its digest")
        return rec

    def summary(self) -> dict[str, Any]:
        """What ``status`` shows of a stored arena (no layout, no checksums)."""
        return {"digest": self.digest, "rank": self.global_rank, "stage": self.stage,
                "transport": self.transport, "bytes": self.total_bytes, "tensors": len(self.entries),
                "daemon_id": self.daemon_id, "pid": self.pid, "deposited_at": self.deposited_at,
                "origin": self.origin, "generation": self.generation, "checkpoint": self.checkpoint}
