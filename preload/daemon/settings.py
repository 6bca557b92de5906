"""What a daemon serves and how, declared once.

The ``preload`` verb's options (:class:`preload.daemon.launcher.PreloadOptions`)
and each rank's orders (:class:`preload.daemon.stage.RankConfig`) both carry
these fields, and the launcher hands them on as they are, so a setting added
here reaches every rank without a second list to keep in step. No torch: the
launcher imports this before its preflight.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# A rank's exit status after it handed its arena over to a successor
# (``--take-over``, preload.daemon.rank): its launcher ends without error
# once every rank did.
HANDED_OVER_EXIT = 75


@dataclass
class DaemonSettings:
    checkpoint: str
    stage: str = "raw"
    transport: str = "shm"
    socket_root: str | None = None
    unsafe_identity: str | None = None
    # Engine settings for the loaded/processed stages (dtype, max_model_len...);
    # a rank's also carry the tp/pp/dp sizes.
    engine: dict[str, Any] = field(default_factory=dict)
    # Deposit each rank's arena in the fd store and re-adopt a stored one
    # (issue 26: preload.daemon.adopt); False: ``--no-fd-store``.
    fd_store: bool = True
    # ``--take-over``: ask a running daemon for the same digest and rank to
    # hand its stored arena over, then adopt it (issue 26).
    take_over: bool = False
    # ``--orphan-ttl``: how long the store keeps a rank's arena once its daemon
    # is gone without stopping (a crash, kill -9); 0: until ``preload-gate stop``
    # (issue 39: written in the arena's record, shown by status).
    orphan_ttl_s: float = 3600.0

    def daemon_settings(self, **changes: Any) -> dict[str, Any]:
        """These fields by name, with ``changes`` (a subclass's own fields left out)."""
        return {**{f.name: getattr(self, f.name) for f in fields(DaemonSettings)}, **changes}
