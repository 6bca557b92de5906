"""Our cache: the preload daemon and the ``verified_cache`` loader, keyed by content.

Runs through the gate's daemon path (:func:`harness.gate.run_gate`): one
daemon holds the base, each candidate is served by a cached engine that
must hit where the weights and settings equal the base's and miss loudly
everywhere else; every load records an event the verdict checks against
the gate's own hash of the candidate.
"""

from __future__ import annotations

from harness.targets.base import CacheTarget


class VerifiedCacheTarget(CacheTarget):
    name = "verified_cache"
    summary = "our daemon and loader: the cache key is the checkpoint's content digest"
    records_events = True
    uses_daemon_path = True
    unsafe_identity: str | None = None
    default_cases: tuple[str, ...] = ()  # `all`: the whole catalogue
