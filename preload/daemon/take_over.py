"""``preload --take-over`` (issues 26, 39): ask the daemon serving the same
digest and rank to hand its stored arena over, then take its rank lock.

The successor's key (computed before any read: :func:`preload.daemon.adopt.expected_key`)
is compared with the running daemon's (its ``stats``) *before* it is asked
(:func:`same_key_or_refuse`): a successor that could not adopt must not make
the old daemon let go, or nothing serves while it reads the disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pgbase.errors import PreloadGateError
from preload.daemon.adopt import expected_key
from preload.daemon.lock import RankBusyError, RankLock
from preload.daemon.stage import RankConfig
from preload.identity.key import WeightCacheKey
from preload.sockets import socket_dir
from preload.transports import get_transport

log = logging.getLogger("preload.daemon")


TAKE_OVER_S = 60.0


def ask(digest: str, cfg: RankConfig) -> dict[str, Any] | None:
    """Ask the daemon serving ``digest`` for this rank to hand its arena over
    (``hand_over``); its answer (pid, daemon_id), or None when none answers
    (then this rank starts as without ``--take-over``). Raises
    PreloadGateError with the old daemon's reason when it refuses."""
    from preload.client import DaemonClient
    from preload.sockets import socket_path

    sdir = socket_dir(digest, cfg.socket_root)
    if not socket_path(sdir, cfg.global_rank).exists():
        log.info("rank %d: --take-over: no daemon serves %s here; starting as a first daemon",
                 cfg.global_rank, digest[:16])
        return None
    try:
        client = DaemonClient.connect(sdir, cfg.global_rank, client="preload-gate take-over")
    except PreloadGateError as exc:
        log.info("rank %d: --take-over: the daemon there does not answer (%s); starting as a first daemon",
                 cfg.global_rank, exc)
        return None
    try:
        # The key first (issue 39): a successor that could not adopt must not make the old daemon let go.
        same_key_or_refuse(cfg, digest, client.stats())
        reply = client.hand_over("preload-gate take-over")
    except PreloadGateError as exc:
        if isinstance(exc, TakeOverKeyError):
            raise
        raise PreloadGateError(f"rank {cfg.global_rank}: --take-over refused: {exc}") from exc
    finally:
        client.close()
    log.warning("rank %d: --take-over: daemon %s (pid %s) hands its arena over", cfg.global_rank,
                reply.get("daemon_id"), reply.get("pid"))
    return reply


class TakeOverKeyError(PreloadGateError):
    """``--take-over`` refused before asking: this successor would not adopt the running daemon's arena."""


def same_key_or_refuse(cfg: RankConfig, digest: str, stats: dict[str, Any]) -> None:
    """Refuse (TakeOverKeyError, one line) unless this rank's key, computed
    before any read, equals the running daemon's in every field: only then
    does the successor adopt what it is handed; otherwise the old daemon
    would stop and nothing would serve while the successor reads the disk."""
    pid = stats.get("pid")
    key = expected_key(cfg, digest, get_transport(cfg.transport))
    if key is None:
        raise TakeOverKeyError(
            f"--take-over refused before asking daemon pid {pid} to hand over: the {cfg.stage} "
            "stage's key is known only after reading the checkpoint, so this successor could not adopt the "
            "arena; the old daemon keeps serving (stop it and start this one, or use --stage raw)")
    try:
        theirs = WeightCacheKey.from_json(stats.get("key") or {})
    except ValueError as exc:
        raise TakeOverKeyError(f"--take-over refused: daemon pid {pid} sent a key that does not "
                               f"parse ({exc}); the old daemon keeps serving") from None
    fields = key.mismatched_fields(theirs)
    if fields:
        shown = ", ".join(f"{f} (running {getattr(theirs, f)!r}, this one {getattr(key, f)!r})" for f in fields)
        raise TakeOverKeyError(
            f"--take-over refused: this daemon's key differs from the running one's (pid {pid}) in "
            f"{shown}; it could not adopt the arena, so the old daemon keeps serving; stop it "
            f"(preload-gate stop {digest[:16]}) and start this one to serve the new key")


def lock_after(digest: str, cfg: RankConfig,
               lock_rank: Callable[[str, RankConfig], tuple[Path, RankLock]]) -> tuple[Path, RankLock]:
    """The rank lock once the handing-over daemon let it go (it stops right
    after its answer); PreloadGateError after TAKE_OVER_S."""
    end = time.monotonic() + TAKE_OVER_S
    while True:
        try:
            return lock_rank(digest, cfg)
        except RankBusyError as exc:
            if time.monotonic() > end:
                raise PreloadGateError(f"rank {cfg.global_rank}: --take-over: the old daemon did not stop "
                                       f"within {TAKE_OVER_S:.0f} s ({exc}); stop it and start this one "
                                       "again") from exc
            time.sleep(0.05)
