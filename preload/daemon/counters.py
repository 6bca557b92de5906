"""What one rank counts: answers, the attaches engines confirmed, the ones they did not.

A get_state answered ok is *served*. It becomes a *hit* only when the engine
says it attached (an ``attached`` report on the same connection,
:class:`preload.protocol.Attached`), and an *attach failure* when the engine
says it failed (by kind: ``attach``, ``verify``, ``digest``) or when its
connection closes before any report (``closed``: the engine died or was
killed mid-attach). So ``hits`` are engines that got their weights, not
replies that left, and ``attaching`` is what is served and not yet reported.

Every method is called under the rank server's mutex (the one that also
guards its arena), so a snapshot never sees half of a move.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from preload import protocol


@dataclass
class Session:
    """One connection's part: who it is (from its hello) and the states
    served on it that its engine has not reported on yet."""

    client: str = ""
    pid: int | None = None
    pending: int = 0


@dataclass
class RankStats:
    hits: int = 0
    served: int = 0
    misses: Counter[str] = field(default_factory=Counter)
    attach_failures: Counter[str] = field(default_factory=Counter)
    attaching: int = 0
    last_attach_failure: dict[str, Any] | None = None
    attached: int = 0
    requests: int = 0
    bad_frames: int = 0
    releases: int = 0
    # Where the arena came from and went (issue 26, preload.daemon.adopt):
    # taken over from the fd store proven, a stored arena that failed its
    # proof, read from disk, dropped from the store by a release or a stop.
    adopted: int = 0
    proof_failed: int = 0
    loaded_from_disk: int = 0
    evicted: int = 0

    def count_served(self, session: Session) -> None:
        """A get_state reply with the arena went out on ``session``."""
        self.served += 1
        self.attaching += 1
        session.pending += 1

    def count_report(self, session: Session, body: dict[str, Any]) -> str | None:
        """Apply an ``attached`` report (already schema-checked); the problem
        when there is nothing on ``session`` to report on (None: counted)."""
        if session.pending == 0:
            return "attached: no get_state answered ok on this connection is waiting for a report"
        session.pending -= 1
        self.attaching -= 1
        if body["ok"]:
            self.hits += 1
        else:
            self._failed(session, str(body["kind"]), str(body.get("detail", "")))
        return None

    def count_closed(self, session: Session) -> None:
        """``session``'s connection closed: what it left unreported failed."""
        if session.pending:
            n, session.pending = session.pending, 0
            self.attaching -= n
            for _ in range(n):
                self._failed(session, protocol.CLOSED_BEFORE_REPORT,
                             "the connection closed before the engine reported its attach")

    def _failed(self, session: Session, kind: str, detail: str) -> None:
        self.attach_failures[kind] += 1
        self.last_attach_failure = {"kind": kind, "detail": detail, "client": session.client,
                                    "pid": session.pid, "at": time.time()}

    def to_json(self) -> dict[str, Any]:
        return {
            "attached": self.attached, "hits": self.hits, "served": self.served,
            "attach_failures": dict(self.attach_failures), "attaching": self.attaching,
            "last_attach_failure": self.last_attach_failure, "misses": dict(self.misses),
            "requests": self.requests, "bad_frames": self.bad_frames,
            "adopted": self.adopted, "proof_failed": self.proof_failed,
            "loaded_from_disk": self.loaded_from_disk, "evicted": self.evicted,
        }
