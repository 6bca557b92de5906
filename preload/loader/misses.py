"""The loader's misses decided before any daemon is asked, each with what to do next.

Two questions come before a connect: which content this engine wants (the
digest, or why there is none), and whether this rank has a socket for it.
Their answers are misses whose line must lead to the right act: a miss that
says "promote" for a checkpoint promote refuses, or "start a daemon" while
one already serves under another socket root (a second resident copy), sends
the operator the wrong way. No vLLM here, so each reason is a function a
unit test calls (``tests/unit/test_loader_misses.py``);
:mod:`preload.loader.verified_cache` raises them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pgbase.digest_text import short_digest
from pgbase.errors import CheckpointError, ManifestError, WeightCacheUnavailableError
from preload.loader.options import LoaderOptions
from preload.sockets import SOCKET_ROOT_ENV

log = logging.getLogger("preload.loader")


class Miss(Exception):
    """Why the cache was not used, with what the event needs."""

    def __init__(self, outcome: str, reason: str, fields: list[str] | None = None,
                 daemon_digest: str | None = None, cause: BaseException | None = None) -> None:
        super().__init__(reason)
        self.outcome, self.reason, self.fields = outcome, reason, list(fields or [])
        self.daemon_digest, self.cause = daemon_digest, cause


def _cannot_serve(exc: CheckpointError, opts: LoaderOptions) -> Miss:
    then = "; this engine loads it from disk (fallback)" if opts.fallback else ""
    return Miss("miss", f"{exc}{then}", cause=exc)


def not_servable(checkpoint: str | os.PathLike[str]) -> CheckpointError | None:
    """Why the cache cannot serve ``checkpoint`` whatever is promoted (vLLM
    loads ``.bin`` weights there, a ``*.safetensors`` that is a directory...),
    by promote's own file-set check; None when it can, or when asking fails
    (the caller's own reason then stands)."""
    from pgbase.shards import shard_paths

    try:
        shard_paths(checkpoint)
    except CheckpointError as exc:
        return exc
    except Exception as exc:  # a better reason is a hint: it never fails the load
        log.debug("the servability check of %s failed: %s: %s", checkpoint, type(exc).__name__, exc)
    return None


def resolve(opts: LoaderOptions, checkpoint: str, event: Any) -> str:
    """This engine's content digest, or the :class:`Miss` saying why there is none.

    A missing or stale manifest normally means "run promote", but promote
    refuses a checkpoint the cache cannot serve (``.bin`` weights): then the
    miss says that instead. The file set is listed only on this miss path, so
    a restart that resolves costs its stats alone.
    """
    if opts.unsafe_identity == "header_only":
        from preload.identity.anchors import header_only_digest

        log.warning("UNSAFE: unsafe_identity=header_only: keying the cache by vLLM's header-only hash")
        event.identity = "header_only"
        return header_only_digest(checkpoint)
    from preload.identity.manifest import StaleManifestError, resolve_digest

    try:
        return resolve_digest(checkpoint, mode=opts.identity, expected_digest=opts.expected_digest).digest
    except StaleManifestError as exc:
        # Stale or missing manifest: a named miss (never a re-hash).
        refused = not_servable(checkpoint)
        if refused is not None:
            raise _cannot_serve(refused, opts) from exc
        raise Miss("miss", str(exc), cause=exc) from exc
    except CheckpointError as exc:  # identity "full": a file set the cache cannot serve
        raise _cannot_serve(exc, opts) from exc
    except (ManifestError, ValueError) as exc:
        raise Miss("error", f"cannot resolve the checkpoint digest: {exc}", cause=exc) from exc


def no_socket(opts: LoaderOptions, sdir: Path, global_rank: int, digest: str, checkpoint: str) -> Miss:
    """The miss for a rank with no socket in ``sdir`` (no sibling rank serves either).

    With the socket directory derived from a root (no ``socket_dir`` in the
    extra config), the user's daemon registry is asked whether a live daemon
    holds this rank's socket for this digest under another root (a daemon
    started with ``--socket-root``, an engine without it): that root is
    named, with how to point the engine there. Otherwise the line says which
    daemon to start.
    """
    cause = WeightCacheUnavailableError("no daemon for this digest")
    where = f"no socket for rank {global_rank} in {sdir} (content digest {short_digest(digest)}"
    if not opts.socket_dir:
        from preload.daemon.registry import roots_serving

        own = os.path.abspath(sdir.parent)
        others = [r for r in roots_serving(digest, global_rank) if os.path.abspath(r) != own]
        if others:
            root = others[0]
            extra = json.dumps({"socket_root": str(root)})
            return Miss("miss", f"no daemon for this digest in this engine's socket root: {where}), but a live "
                        f"daemon serves it under socket root {root}: point the engine there (socket_root in its "
                        f"loader extra config, --model-loader-extra-config '{extra}', or {SOCKET_ROOT_ENV}="
                        f"{root}) rather than starting a second daemon", fields=["socket_root"], cause=cause)
    return Miss("miss", f"no daemon for this digest: {where}; start: preload-gate preload {checkpoint})",
                fields=[] if opts.socket_dir else ["content_digest"], cause=cause)
