"""Why a daemon rank read its checkpoint from disk instead of adopting a
stored arena (issue 39).

Every disk read by a rank says why, once, in three places: the rank's
``rank_ready`` line (so the launcher's ``ready`` line, ``disk_reason`` per
rank), one load event (:func:`preload.events.emit`, outcome ``miss``, mode
``adopt``, source ``disk``, ``fields`` the key's differing fields) and one
log line. A successor after a crash thus says whether there was no store,
the store was lost (its keeper died), the arena expired (when), its key
differs (which fields) or its proof failed, never only ``origin=disk``.

:func:`explain` makes one decision: the first thing that stood between the
rank and adoption, as a :class:`DiskReason` of one of :data:`KINDS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from preload.daemon.adopt import Outcome, expired_why
from preload.daemon.keeper_start import expired_at
from preload.daemon.stage import RankConfig
from preload.events import LoadEvent, emit

log = logging.getLogger("preload.daemon")

KINDS = (
    "no_store",  # --no-fd-store, or no keeper runs under the socket root
    "store_lost",  # the keeper's socket is there and nobody answers (it died), or the store failed
    "nothing_stored",  # the store runs and holds nothing for this digest and rank
    "arena_expired",  # the orphan was dropped at the end of its TTL (when)
    "stage_differs",  # stored under another stage or transport
    "key_differs",  # stored under another key (which fields)
    "proof_failed",  # stored, but its proof (seals, size, checksums) failed: dropped
    "key_unknown",  # this rank's key is known only after the fill (loaded/processed stages)
    "digest_unknown",  # no manifest and no --expect-digest: the digest comes from the bytes
    "unsafe_identity",  # the header-only negative control never adopts
)
# Kinds that follow a first start as well as a crash: logged at INFO, not loud.
_QUIET = ("no_store", "nothing_stored", "key_unknown", "digest_unknown", "unsafe_identity")


@dataclass(frozen=True)
class DiskReason:
    kind: str
    why: str
    fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"disk reason {self.kind!r} is not one of {KINDS}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "why": self.why, "fields": list(self.fields)}


def store_missing(cfg: RankConfig, root: str, state: str, digest: str) -> DiskReason:
    """No store handle: ``--no-fd-store``, or the keeper's ``state``
    (:func:`preload.daemon.fdstore.keeper_state`, or the error that opening it
    raised). A keeper that exited idle after the arena expired left the
    expiry behind (:func:`preload.daemon.keeper_start.expired_at`)."""
    if not cfg.fd_store:
        return DiskReason("no_store", "--no-fd-store: this daemon keeps no arena in the fd store and adopts none")
    gone = expired_at(root, digest, cfg.global_rank)
    if gone is not None and state == "absent":
        return DiskReason("arena_expired", expired_why(digest, cfg.global_rank, *gone))
    if state == "absent":
        return DiskReason("no_store", f"no keeper runs under {root} (no keeper.sock): nothing was kept there")
    if state == "unreachable":
        return DiskReason("store_lost", f"{root}/keeper.sock is there but no keeper answers: the keeper died "
                          "(kill -9?) and every arena it held with it")
    return DiskReason("store_lost", f"the fd store under {root} cannot be used: {state}")


def explain(cfg: RankConfig, digest: str | None, root: str, store_state: str,
            outcome: Outcome) -> DiskReason:
    """Why this rank reads from disk. ``store_state`` "": a store handle was
    open (then ``outcome`` says why its arena was not adopted)."""
    if cfg.unsafe_identity is not None:
        return DiskReason("unsafe_identity", "--unsafe-identity: the negative control reads from disk, never adopts")
    if digest is None:
        return DiskReason("digest_unknown", "no promotion manifest and no --expect-digest: the digest is known only "
                          "after reading the bytes; promote the checkpoint to make its arena adoptable")
    if store_state:
        return store_missing(cfg, root, store_state, digest)
    return DiskReason(outcome.kind or "nothing_stored", outcome.why or "the fd store holds no arena for this rank",
                      outcome.fields)


def announce(reason: DiskReason, cfg: RankConfig, digest: str | None, record: Any = None) -> None:
    """One log line and one load event for ``reason`` (a failed proof already
    emitted its own error event in :mod:`preload.daemon.adopt`: logged only)."""
    quiet = reason.kind in _QUIET
    line = f"rank {cfg.global_rank}: reading {cfg.checkpoint} from disk: {reason.kind}: {reason.why}"
    (log.info if quiet else log.warning)("%s", line)
    if reason.kind == "proof_failed":
        return
    emit(LoadEvent("miss", f"{reason.kind}: {reason.why}", fields=list(reason.fields), digest=digest,
                   daemon_digest=getattr(record, "digest", None), mode="adopt", rank=cfg.global_rank,
                   source="disk"), loud=not quiet)
