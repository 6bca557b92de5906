"""The vLLM load format ``verified_cache``: map weights a daemon proved.

Registered through the ``vllm.general_plugins`` entry point
(``preload.loader:register``). Per engine rank:

1. resolve the checkpoint's content digest (``stat``: one stat per shard
   against the promotion manifest, no shard opened; ``pinned``; ``full``),
2. look for this rank's socket in ``socket_dir(digest, root)``: other
   content means another directory, so "no daemon for this digest" (naming
   another registered root that serves this digest, if one does),
3. hello, send the rank's :class:`WeightCacheKey`; on ``ok`` build the model
   on the meta device, attach the arena (``MAP_PRIVATE`` on CPU), restore
   tied aliases, then run ``process_weights_after_loading`` as the stage
   requires,
4. end in exactly one load event (:mod:`preload.events`).

A miss with ``fallback: true`` loads from disk, loudly (warning + event);
with ``fallback: false`` it is a startup failure naming the reason.

Extra config (``--model-loader-extra-config``), unknown keys are an error:
socket_root, socket_dir, mode (zero_copy|copy), fallback, identity
(stat|pinned|full), expected_digest, verify_resident, events_file,
connect_timeout_s, state_timeout_s, and two UNSAFE negative controls for the
gate: ``unsafe_identity: "header_only"`` and ``unsafe_silent_fallback``.

Modules: :mod:`~preload.loader.options` (the extra config, no vLLM),
:mod:`~preload.loader.verified_cache` (the loader class; imports vLLM),
:mod:`~preload.loader.misses` (the misses decided before a connect, no vLLM),
:mod:`~preload.loader.ranks` (this engine's global rank),
:mod:`~preload.loader.resident` (the resident-checksum check). Importing
this package does not import vLLM: the class is built when vLLM calls
:func:`register`.
"""

from __future__ import annotations

from preload.loader.options import LOAD_FORMAT, LoaderConfigError, LoaderOptions


def loader_class() -> type:
    """The ``VerifiedCacheLoader`` class (imports vLLM and torch on first call)."""
    from preload.loader.verified_cache import VerifiedCacheLoader

    return VerifiedCacheLoader


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``verified_cache``.

    With ``PRELOAD_GATE_STAT_WORKERS=N`` in the engine's environment it also
    prepares the restart check's stats (N: about the checkpoint's shard
    count): sets up the io_uring ring, or where io_uring is not used starts
    the stat pool in the background, so a checkpoint of many shards on
    remote storage is checked in about one round trip
    (:func:`preload.identity.filestat.prestart_stats`). A bad N is
    one warning line naming the variable and the fix, and no pool: the
    plugin loads in every vLLM process, and a tuning knob's typo must not
    fail engines that do not even use this load format.
    """
    import logging

    from vllm.model_executor.model_loader import register_model_loader

    from preload.identity import filestat, stat_pool

    register_model_loader(LOAD_FORMAT)(loader_class())
    try:
        workers = stat_pool.stat_workers_wanted()
    except ValueError as exc:
        logging.getLogger("preload.loader").warning("preload-gate: %s; no stat pool started", exc)
        return
    filestat.prestart_stats(workers)


__all__ = ["LOAD_FORMAT", "LoaderConfigError", "LoaderOptions", "loader_class", "register"]
