"""Our cache: the preload daemon and the ``verified_cache`` loader, keyed by content.

Prepare: the base is promoted (or its promotion's manifest passes the stat
check, and its digest is carried on), and one daemon is started on it as an
operator starts it (``preload-gate preload``), under the deployment's engine
arguments. The daemon reads every byte once and hashes it in that pass: it
refuses to serve unless the bytes are the digest the run carries, so the
digest the verdict judges by is proven, not assumed. A candidate the gate
derives is promoted as an operator would (before an in-place overwrite, so
the stat check finds a stale manifest; after a copy). Each candidate is
served by a cached engine that must hit where the weights and settings
equal the base's and miss loudly everywhere else; every load records an
event the verdict checks against the run's own digest of the candidate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.daemon_process import DaemonProcess, DaemonStartError
from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase
from harness.targets._procs import PrepareError
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache, Served


class VerifiedCacheTarget(CacheTarget):
    name = "verified_cache"
    summary = "our daemon and loader: the cache key is the checkpoint's content digest"
    records_events = True
    default_cases: tuple[str, ...] = ()  # `all`: the whole catalogue
    stages_base = False  # the daemon reads the base where it is; candidates are copies
    node_local = True
    reports_fingerprints = True

    def _identity(self, ctx: PrepareContext) -> str | None:
        return ctx.unsafe_identity or self.unsafe_identity

    def controls(self, ctx: PrepareContext) -> dict[str, Any]:
        """What the cached engines' loader is told (the negative controls only)."""
        return {"unsafe_identity": self._identity(ctx), "unsafe_silent_fallback": ctx.unsafe_silent_fallback,
                "env": dict(ctx.env)}

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        digest = ctx.promote(base)  # promoted now, or its manifest passed the stat check
        args = list(ctx.daemon_args)
        if self._identity(ctx):
            args += ["--unsafe-identity", str(self._identity(ctx))]
        daemon = DaemonProcess(str(base), ctx.socket_root, ctx.workdir / "daemon.log", args,
                               env={**ctx.env, **self.child_env()})
        ctx.note("daemon", f"starting the daemon on {base}")
        try:
            daemon.start()
        except DaemonStartError as exc:
            raise PrepareError(str(exc)) from None
        info = {"checkpoint": str(base), "digest": daemon.digest, "independent_digest": digest,
                "start_seconds": round(daemon.start_seconds, 3), "controls": self.controls(ctx)}
        return PreparedCache(settings, Path(ctx.socket_root), digest, info=info, handle=daemon)

    def before_edit(self, cache: PreparedCache, staged: Path, ctx: PrepareContext) -> None:
        # Promoted before the overwrite: a stat-mode engine then finds a
        # manifest the overwrite made stale.
        ctx.promote(staged)

    def place(self, cache: PreparedCache, candidate: Path, ctx: PrepareContext) -> None:
        # An operator promotes what they serve; engines never hash or write
        # manifests (a missing one is a miss, issue 11). A candidate whose
        # manifest passes the stat check (the promotion's) is not hashed again.
        ctx.promote(candidate)

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        extra: dict[str, Any] = {"fallback": expect == "miss", "identity": "stat",
                                 "socket_root": str(cache.location)}
        controls = cache.info.get("controls", {})
        if controls.get("unsafe_identity"):
            extra["unsafe_identity"] = controls["unsafe_identity"]
        if controls.get("unsafe_silent_fallback"):
            extra["unsafe_silent_fallback"] = True
        return EngineSpec(checkpoint=str(candidate), load_format="verified_cache", extra_config=extra,
                          env=dict(controls.get("env", {})), **common)

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        return Served(hit_proven=True, events=result.events)

    def close(self, cache: PreparedCache) -> None:
        if cache.handle is not None:
            cache.handle.stop()
            cache.handle = None
