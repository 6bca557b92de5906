"""Re-adoption: a daemon rank takes over the arena an earlier daemon left in
the fd store, proven, instead of reading the checkpoint (issue 26).

:func:`try_adopt` is asked before a rank fills, when its digest is known
(a manifest or ``--expect-digest``). It fetches ``(digest, global_rank)``
from the store (:func:`preload.daemon.fdstore.open_store`); a stored arena
is taken over only when its record's stage and transport are this rank's
and its key (``WeightCacheKey``) differs from the key this rank would
serve in no field. Then ``Transport.adopt`` builds the sealed arena from
the fds and ``Transport.prove`` proves it (shm: its seals and size; cuda:
the resident checksums recorded when the bytes were hashed). Only a proven
arena serves: as a :class:`~preload.daemon.stage.Filled` with
``load_seconds`` 0, ``bytes_read`` 0, ``origin`` ``adopted`` and the
record's generation + 1.

A failed proof, or an arena the transport cannot adopt, is a loud load
event (:func:`preload.events.emit`, outcome ``error``, mode ``adopt``)
naming the rank and the reason; the stored arena is dropped and the rank
loads from disk. After any fill, :func:`deposit` puts the rank's arena in
the store (origin ``disk`` or ``adopted``), so the next daemon can take it.
No torch here beyond what the transport already imported.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pgbase.errors import PreloadGateError
from preload.daemon.arena_record import ArenaRecord
from preload.daemon.fdstore import FdStore, FdStoreError
from preload.daemon.stage import Filled, RankConfig
from preload.events import LoadEvent, emit
from preload.identity.key import WeightCacheKey
from preload.transports.base import AdoptError, ArenaProofError, Layout, Transport

log = logging.getLogger("preload.daemon")


@dataclass
class Outcome:
    """What :func:`try_adopt` found: ``filled`` (None: load from disk),
    ``record`` (the stored one, when there was one), ``why`` (why not
    adopted, "" when adopted or nothing was stored), ``proof_failed``."""

    filled: Filled | None = None
    record: ArenaRecord | None = None
    why: str = ""
    proof_failed: bool = False
    # Why not adopted, as a kind (preload.daemon.disk_reason.KINDS): "" adopted,
    # nothing_stored, arena_expired, stage_differs, key_differs, proof_failed;
    # ``fields``: the key's fields that differ (key_differs).
    kind: str = ""
    fields: tuple[str, ...] = ()


def expected_key(cfg: RankConfig, digest: str, transport: Transport) -> WeightCacheKey | None:
    """The key this rank would serve for ``digest``, computed without
    reading a tensor; None where it cannot be known before the fill (the
    loaded/processed stages: their key comes from vLLM's config built in
    the rank's distributed world)."""
    if cfg.stage == "raw":
        from preload.daemon.raw import raw_key

        return raw_key(
            cfg.checkpoint, digest, transport.name, int(cfg.engine.get("tp_size", 1)), cfg.tp_rank
        )
    return None


def try_adopt(
    cfg: RankConfig,
    digest: str,
    store: FdStore,
    transport: Transport,
    key: WeightCacheKey,
    on_event: Callable[[str], None] = lambda _kind: None,
) -> Outcome:
    """Take over the stored arena for ``(digest, cfg.global_rank)`` if it is
    this rank's (stage, transport, every key field) and proves. ``on_event``
    is told ``adopted`` or ``proof_failed``. Never raises for a stored arena
    that does not fit or prove: that is an :class:`Outcome` with ``why``;
    raises :class:`FdStoreError` only when the store itself fails."""
    rank = cfg.global_rank
    stored = store.fetch(digest, rank)
    if stored is None:
        gone = store.expired(digest, rank)
        if gone is not None:
            return Outcome(kind="arena_expired", why=expired_why(digest, rank, *gone))
        return Outcome(kind="nothing_stored", why=(
            f"the fd store ({store.name}) holds no arena for {digest[:16]} rank {rank} (none deposited, "
            "or dropped by preload-gate stop)"))
    record, fds = stored.record, stored.fds
    why, kind = "", ""
    fields: list[str] = []
    if record.stage != cfg.stage or record.transport != transport.name:
        kind, why = "stage_differs", (
            f"the stored arena is stage {record.stage}/transport {record.transport}; this rank serves "
            f"{cfg.stage}/{transport.name}"
        )
    else:
        theirs, fields = _their_key(record, key)
        if theirs is None:
            kind, why = "key_differs", "the stored arena's key does not parse"
        elif fields:
            kind, why = "key_differs", f"the stored arena's key differs in {', '.join(fields)}"
    if why:
        for fd in fds:
            os.close(fd)
        log.info("rank %d: not adopting the stored arena: %s; loading from disk", rank, why)
        return Outcome(record=record, why=why, kind=kind, fields=tuple(fields))
    start = time.perf_counter()
    try:
        layout = Layout.from_json(record.entries, record.total_bytes)
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        return _failed(cfg, digest, store, record, f"its layout is malformed: {exc}", on_event)
    try:
        arena = transport.adopt(record.descriptor, fds, layout)  # owns fds from here
    except AdoptError as exc:
        return _failed(
            cfg, digest, store, record, f"the transport cannot adopt it: {exc}", on_event
        )
    try:
        proof = transport.prove(arena, record.checksums)
    except ArenaProofError as exc:
        arena.close()
        return _failed(cfg, digest, store, record, f"its proof failed: {exc}", on_event)
    seconds = time.perf_counter() - start
    filled = Filled(
        arena=arena,
        layout=layout,
        key=key,
        digest=digest,
        stage=record.stage,
        aliases=dict(record.aliases),
        shard_digests=dict(record.shard_digests),
        checksums=dict(record.checksums),
        load_seconds=0.0,
        bytes_read=0,
        origin="adopted",
        generation=record.generation + 1,
        adopt_seconds=seconds,
    )
    on_event("adopted")
    log.info(
        "rank %d: adopted the stored arena of daemon %s (pid %d, generation %d), proven by %s over %d "
        "tensors in %.4f s; no checkpoint byte read",
        rank,
        record.daemon_id,
        record.pid,
        filled.generation,
        proof.method,
        proof.tensors,
        seconds,
    )
    return Outcome(filled=filled, record=record)


def expired_why(digest: str, rank: int, when: float, ttl: float) -> str:
    """The stored arena expired: when, how long ago, after what TTL."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    return (f"the stored arena of {digest[:16]} rank {rank} expired at {stamp} ({time.time() - when:.0f} s "
            f"ago), after its {ttl:g} s orphan TTL (--orphan-ttl)")


def _their_key(record: ArenaRecord, key: WeightCacheKey) -> tuple[WeightCacheKey | None, list[str]]:
    """The stored key and the fields in which ``key`` differs from it (None: it does not parse)."""
    try:
        theirs = WeightCacheKey.from_json(record.key)
    except ValueError:
        return None, []
    return theirs, list(key.mismatched_fields(theirs))


def _failed(
    cfg: RankConfig,
    digest: str,
    store: FdStore,
    record: ArenaRecord,
    why: str,
    on_event: Callable[[str], None],
) -> Outcome:
    """A stored arena that cannot serve: a loud event naming the rank, the
    arena dropped from the store, the rank loads from disk."""
    rank = cfg.global_rank
    reason = (
        f"rank {rank}: the stored arena (daemon {record.daemon_id}, pid {record.pid}) is not adopted, "
        f"{why}; dropped it, loading from disk"
    )
    on_event("proof_failed")
    emit(
        LoadEvent(
            "error",
            reason,
            digest=digest,
            daemon_digest=record.digest,
            mode="adopt",
            rank=rank,
            tensors=len(record.entries),
            bytes=record.total_bytes,
            source="disk",
        ),
        loud=True,
    )
    try:
        store.drop(digest, rank)
    except FdStoreError as exc:
        log.warning("rank %d: could not drop the unproven arena from the store: %s", rank, exc)
    return Outcome(record=record, why=why, proof_failed=True, kind="proof_failed")


def deposit(
    store: FdStore,
    filled: Filled,
    cfg: RankConfig,
    daemon_id: str,
    checkpoint: str,
    previous: ArenaRecord | None = None,
) -> ArenaRecord | None:
    """Put ``filled``'s sealed arena in ``store`` so a successor can adopt
    it; returns the record, or None (logged) when the arena cannot outlive
    this daemon or the store refuses. ``previous``: the record it was
    adopted from (its disk cost is carried on)."""
    from preload.checksum import SCHEME

    try:
        descriptor, fds = filled.arena.deposit()
    except (AdoptError, RuntimeError) as exc:
        log.info("rank %d: nothing deposited in the fd store: %s", cfg.global_rank, exc)
        return None
    try:
        record = ArenaRecord(
            digest=filled.digest,
            global_rank=cfg.global_rank,
            key=filled.key.to_json(),
            stage=filled.stage,
            transport=cfg.transport,
            descriptor=descriptor,
            nfds=len(fds),
            entries=filled.layout.to_json(),
            total_bytes=filled.layout.total_bytes,
            daemon_id=daemon_id,
            pid=os.getpid(),
            deposited_at=time.time(),
            aliases=dict(filled.aliases),
            shard_digests=dict(filled.shard_digests),
            checksums=dict(filled.checksums),
            checksum_scheme=SCHEME if filled.checksums else "",
            checkpoint=checkpoint,
            origin=filled.origin,
            generation=filled.generation,
            load_seconds=previous.load_seconds if previous is not None else filled.load_seconds,
            bytes_read=previous.bytes_read if previous is not None else filled.bytes_read,
            orphan_ttl_s=cfg.orphan_ttl_s,
        )
        store.deposit(record, fds)
    except (FdStoreError, PreloadGateError, ValueError) as exc:
        log.warning(
            "rank %d: the fd store did not take the arena (a crash will mean a reload): %s",
            cfg.global_rank,
            exc,
        )
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return record
