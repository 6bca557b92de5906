"""The loader's misses, each ending with the act that fixes it.

A miss line must lead to the right act: one that says "promote" for a
checkpoint promote refuses, "start a daemon" while one already serves under
another socket root (a second resident copy), or names differing key fields
and stops there, sends the operator the wrong way or nowhere. So every miss
is made here, by one function per reason (:data:`REASONS`), and its line
ends with the act: the exact command where one exists. No vLLM here, so a
unit test calls each (``tests/unit/test_loader_misses.py``: one row per
reason); :mod:`preload.loader.verified_cache` raises them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pgbase.digest_text import short_digest
from pgbase.errors import (
    CacheKeyMismatchError,
    CheckpointError,
    DaemonBusyError,
    ManifestError,
    WeightCacheUnavailableError,
)
from pgbase.oscause import reason
from preload.identity.key import WeightCacheKey
from preload.loader.options import LoaderOptions
from preload.sockets import SOCKET_ROOT_ENV

log = logging.getLogger("preload.loader")

# Every reason a miss (or error) event can carry, by the function that makes it.
REASONS = (
    "stale_manifest", "untrusted_cache", "cannot_serve", "unresolved", "socket_path", "no_daemon", "other_root",
    "daemon_unavailable", "daemon_busy", "key_mismatch", "bad_answer", "wrong_digest", "attach_failed",
)


class Miss(Exception):
    """Why the cache was not used, with what the event needs."""

    def __init__(self, outcome: str, reason: str, fields: list[str] | None = None,
                 daemon_digest: str | None = None, cause: BaseException | None = None, kind: str = "") -> None:
        super().__init__(reason)
        self.outcome, self.reason, self.fields = outcome, reason, list(fields or [])
        self.daemon_digest, self.cause = daemon_digest, cause
        self.kind = kind  # one of REASONS


def preload_command(checkpoint: str, sdir: Path, flags: Sequence[str] = ()) -> str:
    """``preload-gate preload CKPT`` for the daemon an engine with socket dir
    ``sdir`` looks for: absolute, quoted, with the engine's socket root where
    it is not the default, its cache where it is not (as promote's command),
    then ``flags``."""
    from preload.identity.manifest import promote_command
    from preload.sockets import default_socket_root

    cmd = promote_command(checkpoint, verb="preload")
    root = sdir.parent
    if os.path.abspath(root) != os.path.abspath(default_socket_root()):
        cmd += f" --socket-root {shlex.quote(os.path.abspath(root))}"
    cmd = " ".join([cmd, *flags])
    if not (len(sdir.name) == 16 and all(c in "0123456789abcdef" for c in sdir.name)):
        # A daemon listens in <root>/<digest[:16]>: no daemon ever serves this socket_dir.
        cmd += f", and drop socket_dir {sdir} from the engine's loader extra config (a daemon listens in " \
               "<socket root>/<digest[:16]>)"
    return cmd


def _stop(sdir: Path, pid: Any, rank: int) -> str:
    who = f"pid {pid}, rank {rank}" if pid else f"rank {rank}"
    return f"stop the daemon on {sdir} ({who}; preload-gate status lists every rank)"


def stale_manifest(exc: ManifestError) -> Miss:
    """A missing or stale manifest; its message ends with the promote command
    (or, on a stat-blind filesystem, the identity modes that work there)."""
    return Miss("miss", str(exc), cause=exc, kind="stale_manifest")


def untrusted_cache(exc: Exception) -> Miss:
    """The manifest (or its directory) fails the trust rule: whoever wrote it
    could point this engine at other weights. Its message ends with the fix
    (chmod, or a cache of the engine's own through PRELOAD_GATE_CACHE)."""
    return Miss("error", f"refusing the manifest cache: {exc}", cause=exc, kind="untrusted_cache")


def cannot_serve(exc: CheckpointError, opts: LoaderOptions, checkpoint: str) -> Miss:
    """A checkpoint the cache cannot serve whatever is promoted; the refusal
    says what to do (convert, --load-format auto), the fallback goes first."""
    then = "this engine loads it from disk (fallback): " if opts.fallback else ""
    text = str(exc)
    if not os.path.lexists(checkpoint):  # a hub id, say: vLLM downloads it, the cache never sees it
        text += ("; verified_cache serves a local folder: download it (huggingface-cli download "
                 f"{checkpoint} --local-dir DIR), promote DIR and give the engine DIR")
    return Miss("miss", then + text, cause=exc, kind="cannot_serve")


def unresolved(exc: Exception, checkpoint: str) -> Miss:
    """The digest cannot be resolved (a malformed manifest, a bad expected_digest)."""
    text = f"cannot resolve the checkpoint digest: {exc}"
    if "run: " not in text:
        text += ("; fix identity/expected_digest in the loader extra config (expected_digest: the digest "
                 f"promote printed), or promote again: {_promote(checkpoint)}")
    return Miss("error", text, cause=exc, kind="unresolved")


def _promote(checkpoint: str) -> str:
    from preload.identity.manifest import promote_command

    return promote_command(checkpoint)


def socket_path(problem: str) -> Miss:
    """The rank's socket path cannot be an AF_UNIX path (too long): known before any connect."""
    text = (f"{problem}; give the daemon and this engine one shorter root: --socket-root DIR for "
            f"preload-gate preload and socket_root in the engine's loader extra config, or {SOCKET_ROOT_ENV}=DIR "
            "for both")
    return Miss("miss", text, cause=WeightCacheUnavailableError(problem), kind="socket_path")


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
    from preload.trust import UntrustedPathError

    try:
        return resolve_digest(checkpoint, mode=opts.identity, expected_digest=opts.expected_digest).digest
    except StaleManifestError as exc:
        # Stale or missing manifest: a named miss (never a re-hash).
        refused = not_servable(checkpoint)
        if refused is not None:
            raise cannot_serve(refused, opts, checkpoint) from exc
        raise stale_manifest(exc) from exc
    except UntrustedPathError as exc:
        raise untrusted_cache(exc) from exc
    except CheckpointError as exc:  # identity "full": a file set the cache cannot serve
        raise cannot_serve(exc, opts, checkpoint) from exc
    except (ManifestError, ValueError) as exc:
        raise unresolved(exc, checkpoint) from exc


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
                        f"daemon serves it under socket root {root}; rather than starting a second daemon, "
                        f"point the engine there: socket_root in its loader extra config "
                        f"(--model-loader-extra-config '{extra}') or {SOCKET_ROOT_ENV}={root}",
                        fields=["socket_root"], cause=cause, kind="other_root")
    return Miss("miss", f"no daemon for this digest: {where}); start one: {preload_command(checkpoint, sdir)}",
                fields=[] if opts.socket_dir else ["content_digest"], cause=cause, kind="no_daemon")


def daemon_unavailable(exc: Exception, sdir: Path, rank: int, checkpoint: str) -> Miss:
    """The rank's socket is there, but no daemon answers on it as it should
    (or one does, busy: its listen backlog stayed full for the connect timeout)."""
    if isinstance(exc, DaemonBusyError):
        extra = json.dumps({"connect_timeout_s": 30})
        return Miss("miss", f"daemon busy: {exc}; it is alive: do not start another (its rank lock refuses a second); "
                    f"raise connect_timeout_s in the loader extra config (--model-loader-extra-config '{extra}'), "
                    "or start fewer engines at once", cause=exc, kind="daemon_busy")
    return Miss("miss", f"daemon unavailable: {exc}; preload-gate status says whether a daemon serves {sdir}; "
                f"if none does, start one: {preload_command(checkpoint, sdir)}", cause=exc,
                kind="daemon_unavailable")


def bad_answer(exc: Exception, sdir: Path, pid: Any, rank: int, checkpoint: str) -> Miss:
    """The daemon answered get_state outside the protocol (another release, or broken)."""
    return Miss("error", f"the daemon's answer broke the protocol: {exc}; it runs another preload-gate "
                f"release than this engine, or is broken: {_stop(sdir, pid, rank)} and start it from this "
                f"engine's environment: {preload_command(checkpoint, sdir)}", cause=exc, kind="bad_answer")


def wrong_digest(sdir: Path, daemon_digest: str, digest: str, pid: Any, rank: int, checkpoint: str) -> Miss:
    """A daemon in this digest's socket dir serves other content (a misplaced or hand-started one)."""
    return Miss("error", f"daemon in {sdir} serves digest {short_digest(daemon_digest)}, not {short_digest(digest)}, "
                f"though the directory is this digest's; {_stop(sdir, pid, rank)} and start the right one: "
                f"{preload_command(checkpoint, sdir)}", ["content_digest"], daemon_digest,
                CacheKeyMismatchError(["content_digest"]), kind="wrong_digest")


def attach_failed(exc: BaseException) -> Miss:
    """The keys agree but the daemon's tensors would not attach to this engine's model."""
    # A system failure (an errno, a failed allocation) named by its real cause (pgbase.oscause).
    what = str(exc) if isinstance(exc, CheckpointError | WeightCacheUnavailableError) else reason(exc)
    return Miss("error", f"attach failed: {what}; the keys agree, so this is a preload-gate bug: report it with "
                "the engine's and the daemon's logs, and meanwhile load from disk (fallback: true in the "
                "loader extra config, or --load-format auto)", cause=exc, kind="attach_failed")


def key_mismatch(exc: CacheKeyMismatchError, engine: WeightCacheKey, checkpoint: str, sdir: Path, pid: Any,
                 rank: int, serving: list[int] | None = None) -> Miss:
    """The daemon holds another key: the differing fields with both values,
    then the act: the daemon restarted with this engine's values (the exact
    command, :mod:`preload.daemon.key_flags`), or, where no daemon flag sets
    a field, what to change on the engine's side."""
    from preload.daemon.key_flags import (
        ENGINE_ONLY,
        FOLLOW,
        FROM_FOLDER,
        RAW_UNKEYED,
        SETTING_OF,
        SOFTWARE,
        flags_for,
    )

    daemon = _received_key(getattr(exc, "daemon_key", None))
    fields = list(exc.fields)
    head = f"key mismatch on fields: {', '.join(fields)}"
    if serving is not None:
        head = f"the daemon for this digest serves ranks {serving}, not rank {rank}: {head}"
    raw = "export_stage" in fields and daemon.get("export_stage") == "raw"
    # A raw daemon runs no vLLM and keys none of its settings: they follow from the stage.
    considered = [f for f in fields if f not in FOLLOW and not (raw and f in RAW_UNKEYED)]
    # The effective config is config.json after the engine's overrides: with
    # config.json itself changed, it follows the folder (a restart fixes both).
    from_folder = FROM_FOLDER | ({"hf_config_digest"} if "config_digest" in considered else set())
    values = [f"{f}: engine {_shown(getattr(engine, f, None))}, daemon {_shown(daemon.get(f))}"
              for f in considered if f not in from_folder]
    parts = [head + (f" ({'; '.join(values)})" if values else "")]
    if raw:
        parts.append(f"a raw-stage daemon serves checkpoint tensors for consumers without vLLM; this engine "
                     f"attaches the {engine.export_stage} stage")
    folder = [f for f in considered if f in from_folder]
    if folder:
        parts.append(f"{', '.join(folder)} {'comes' if len(folder) == 1 else 'come'} from config.json, which "
                     "changed since the daemon started")
    if any(f in SOFTWARE for f in considered):
        parts.append(f"the daemon runs vLLM {daemon.get('vllm_version')}, this engine {engine.vllm_version}: "
                     "start it from the engine's Python environment")
    engine_only = [f for f in considered if f in ENGINE_ONLY and f not in from_folder]
    if engine_only:
        settings = ", ".join(f"{f}={_shown(getattr(engine, f, None))}"
                             + (f" ({SETTING_OF[f]})" if f in SETTING_OF else "") for f in engine_only)
        defaults = ", ".join(f"{f}={_shown(daemon.get(f))}" for f in engine_only)
        if len(engine_only) == len(considered):  # nothing a daemon restart changes
            parts.append(f"preload-gate preload keys vLLM's defaults ({defaults}) and takes no flag for "
                         f"{', '.join(engine_only)}: run this engine without {settings}, or load from disk "
                         "(fallback: true)")
            return Miss("miss", "; ".join(parts), fields, daemon.get("content_digest"), exc, kind="key_mismatch")
        parts.append(f"and run this engine without {settings} (preload-gate preload keys vLLM's defaults)")
    flags = flags_for(considered, engine)
    answered = serving[0] if serving else rank  # the rank whose daemon answered (its pid)
    parts.append(f"{_stop(sdir, pid, answered)} and start it with this engine's settings: "
                 f"{preload_command(checkpoint, sdir, flags)}")
    return Miss("miss", "; ".join(parts), fields, daemon.get("content_digest"), exc, kind="key_mismatch")


def _received_key(obj: Any) -> dict[str, Any]:
    """The daemon's key with every field: a field at its default is not sent
    (:data:`preload.identity.key.SENT_WHEN_SET`), so read it as the key does."""
    received: dict[str, Any] = dict(obj or {})
    try:
        return dataclasses.asdict(WeightCacheKey.from_json(received))
    except ValueError:  # a key this release cannot read: show what came
        return received


def _shown(value: Any) -> str:
    text = "none" if value is None else str(value)
    return short_digest(text) if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text[:60]
