"""One rank's daemon process: lock, fill, prove, serve until told to stop.

Started by the launcher as ``python -m preload.daemon.rank`` with a JSON
:class:`~preload.daemon.stage.RankConfig` on stdin (no pickle crosses this boundary either). It
prints exactly one JSON line on stdout: ``{"event": "rank_ready", ...}``
when serving, or ``{"event": "rank_error", "error": ...}`` before exiting 2.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pgbase.errors import PreloadGateError
from pgbase.oscause import file_limit, reason
from preload.daemon import disk_reason, take_over
from preload.daemon.adopt import Outcome, deposit, expected_key, try_adopt
from preload.daemon.fdstore import FdStore, FdStoreError, keeper_state, open_store
from preload.daemon.home import remove_if_empty
from preload.daemon.lock import RankLock
from preload.daemon.parent import INTERVAL_S as PARENT_POLL_S
from preload.daemon.parent import ParentWatch
from preload.daemon.server import RankServer
from preload.daemon.settings import HANDED_OVER_EXIT
from preload.daemon.stage import Filled, RankConfig, peak_rss_bytes, rss_bytes
from preload.daemon.store_watch import StoreWatch
from preload.identity.anchors import header_only_digest
from preload.identity.manifest import load_manifest
from preload.sockets import default_socket_root, ensure_private_dir, socket_dir
from preload.transports import get_transport
from preload.trust import UNSAFE_IDENTITIES, require_unsafe_controls

log = logging.getLogger("preload.daemon")


def _fill(cfg: RankConfig, expected: str | None) -> Filled:
    transport = get_transport(cfg.transport)
    manifest = load_manifest(cfg.checkpoint)
    if cfg.stage == "raw":
        from preload.daemon.raw import fill_raw

        # -tp N: each rank holds only its slices (preload.daemon.tp_slice).
        return fill_raw(cfg.checkpoint, transport, expected, manifest,
                        int(cfg.engine.get("tp_size", 1)), cfg.tp_rank)
    if cfg.stage in ("loaded", "processed"):
        from preload.daemon.loaded import fill_model

        return fill_model(cfg, transport, expected, manifest)
    raise PreloadGateError(f"unknown stage {cfg.stage!r} (raw, loaded, processed)")


def _lock_rank(digest: str, cfg: RankConfig) -> tuple[Path, RankLock]:
    """Make the digest's socket directory and lock this rank in it.

    A stopping daemon removes its directory when it is empty (the launcher's
    ``stop``): if that happens between our mkdir and our lock file, make the
    directory again rather than fail.
    """
    attempts = 3
    for attempt in range(attempts):
        sdir = ensure_private_dir(socket_dir(digest, cfg.socket_root))
        try:
            return sdir, RankLock.acquire(sdir, cfg.global_rank)
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def serve_rank(cfg: RankConfig, stop: threading.Event, announce: Any = None,
               parent: ParentWatch | None = None) -> bool:
    """Fill and serve one rank until ``stop`` is set or its launcher (``parent``,
    by default this process's parent now) is gone; True when it ended by
    handing its arena over to a successor (``hand_over``)."""
    parent = parent or ParentWatch()
    if cfg.cpus:
        os.sched_setaffinity(0, cfg.cpus)
        import torch

        torch.set_num_threads(len(cfg.cpus))
    if cfg.transport == "cuda":
        import torch

        # One daemon per local GPU: the arena lives on this rank's device.
        torch.cuda.set_device(cfg.local_rank)
    expected = cfg.expected_digest
    if cfg.unsafe_identity is not None:
        if cfg.unsafe_identity not in UNSAFE_IDENTITIES:
            raise PreloadGateError(f"unknown unsafe identity {cfg.unsafe_identity!r}")
        require_unsafe_controls("--unsafe-identity")
        expected = header_only_digest(cfg.checkpoint)
        log.warning(
            "UNSAFE: --unsafe-identity header_only: serving under vLLM's header-only hash %s and "
            "SKIPPING the byte proof; checkpoints with equal headers and different weights will hit",
            expected[:16],
        )
    lock = None
    store: FdStore | None = None
    adopted: Outcome = Outcome()
    why_disk: disk_reason.DiskReason | None = None
    root = str(cfg.socket_root or default_socket_root())
    counts: dict[str, int] = {}

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    predecessor: dict[str, Any] | None = None
    if cfg.take_over:
        if expected is None:
            raise PreloadGateError("--take-over needs the digest before the fill (a promotion manifest or "
                                   "--expect-digest): promote the checkpoint, or pass --expect-digest")
        predecessor = take_over.ask(expected, cfg)
    if expected is not None:
        sdir, lock = _lock_rank(expected, cfg) if predecessor is None else take_over.lock_after(expected, cfg,
                                                                                               _lock_rank)
    try:
        baseline = rss_bytes()
        # A running store only: nothing (no keeper, no socket) is started
        # for a checkpoint that may yet be refused; the deposit starts one.
        store, store_state = _open_store(cfg, start=False)
        # Re-adoption (issue 26): the digest is known before the fill, and the
        # byte proof is ours (never under the unsafe header-only control).
        if store is not None and expected is not None and cfg.unsafe_identity is None:
            adopted = _adopt(cfg, expected, store, count)
        if adopted.filled is not None:
            filled = adopted.filled
        else:
            # Every read from disk says why (issue 39): ready line, event, log.
            why_disk = disk_reason.explain(cfg, expected, root, store_state, adopted)
            disk_reason.announce(why_disk, cfg, expected, adopted.record)
            filled = _fill(cfg, None if cfg.unsafe_identity else expected)
            count("loaded_from_disk")
        # A stage that imports heavy libraries measures its own baseline after them.
        filled.baseline_rss_bytes = filled.baseline_rss_bytes or baseline
        filled.peak_rss_bytes = peak_rss_bytes()
        if cfg.unsafe_identity is not None:
            import dataclasses

            assert expected is not None
            filled.digest = expected
            filled.key = dataclasses.replace(filled.key, content_digest=expected)
        if lock is None:
            log.warning("no manifest or --expect-digest: serving the digest of the bytes read, %s", filled.digest)
            sdir, lock = _lock_rank(filled.digest, cfg)
    except BaseException:
        if store is not None:
            store.close()
        if lock is not None:
            lock.release()
            remove_if_empty(lock.path.parent)
        raise
    server = RankServer(filled, sdir, cfg.global_rank, lock, checkpoint=os.path.realpath(cfg.checkpoint))
    if predecessor is not None:
        server.took_over_from = {k: predecessor.get(k) for k in ("pid", "daemon_id")}
    for kind, n in counts.items():
        setattr(server.stats, kind, getattr(server.stats, kind) + n)
    try:
        server.start()
    except BaseException:
        if store is not None:
            store.close()
        raise
    if store is None:
        store, _state = _open_store(cfg, start=True)

    def put(into: FdStore) -> bool:
        return deposit(into, filled, cfg, server.daemon_id, server.checkpoint, adopted.record) is not None

    # Deposited before the ready line: a daemon killed right after it leaves its arena stored.
    deposited = store is not None and put(store)
    watch: StoreWatch | None = None
    if store is not None and deposited:
        # The store is watched (issue 39): a lost keeper is replaced and the arena re-deposited.
        watch = StoreWatch(store, root, cfg.global_rank, f"{filled.digest[:16]} rank {cfg.global_rank}, "
                           f"{filled.layout.total_bytes} bytes of {server.checkpoint}", put)
        watch.start()
        server.on_release = lambda: _evict(watch.current(), filled.digest, cfg.global_rank, server)
        server.on_hand_over = stop.set  # the loop below ends; handed_over keeps the arena stored
    clean = False
    try:
        if announce is not None:
            announce({
                "event": "rank_ready", "digest": filled.digest, "socket_dir": str(sdir),
                "socket": str(server.path), "global_rank": cfg.global_rank, "local_rank": cfg.local_rank,
                "tp_rank": cfg.tp_rank, "pp_rank": cfg.pp_rank, "dp_rank": cfg.dp_rank,
                "pid": os.getpid(), "stage": filled.stage, "transport": cfg.transport,
                "bytes": filled.layout.total_bytes, "tensors": len(filled.layout.entries),
                "load_seconds": round(filled.load_seconds, 4), "bytes_read": filled.bytes_read,
                "peak_rss_bytes": filled.peak_rss_bytes, "baseline_rss_bytes": filled.baseline_rss_bytes,
                "daemon_id": server.daemon_id, "gpu_uuid": filled.arena.gpu_uuid,
                "origin": filled.origin, "generation": filled.generation,
                "adopt_seconds": round(filled.adopt_seconds, 4),
                "fd_store": store.name if store is not None and deposited else None,
                "took_over_from": server.took_over_from,
                "disk_reason": why_disk.to_json() if why_disk is not None else None,
            })
        while not stop.wait(PARENT_POLL_S):
            # Orphaned (the launcher was killed -9): stop (preload.daemon.parent).
            if parent.gone():
                log.error("rank %d: the launcher (pid %d) is gone; stopping", cfg.global_rank, parent.parent)
                break
        else:
            # Told to stop (SIGTERM: the launcher's stop): stopping for good;
            # handed over: the successor adopts the stored arena.
            clean = not server.handed_over
    finally:
        if watch is not None:
            store = watch.stop()
        if store is not None:
            # A clean stop takes the arena out of the store; any other end
            # (the launcher gone, an error) leaves it there for a successor.
            if clean and deposited and not server.released:
                _evict(store, filled.digest, cfg.global_rank, server)
            store.close()
        server.stop()
    return server.handed_over


def _open_store(cfg: RankConfig, start: bool) -> tuple[FdStore | None, str]:
    """The fd store of this rank's socket root (started when absent and
    ``start``) and "" ; or None with why: ``--no-fd-store``, the keeper's
    state when none runs and not ``start`` (``absent``/``unreachable``), or
    the error when it cannot be used (logged: the rank then serves as before,
    and a crash means a reload)."""
    if not cfg.fd_store:
        return None, "disabled"
    try:
        store = open_store(cfg.socket_root, start=start)
    except FdStoreError as exc:
        log.warning("rank %d: no fd store (%s); serving without one: a crash of this daemon means a reload",
                    cfg.global_rank, exc)
        return None, str(exc)
    if store is None:
        return None, keeper_state(cfg.socket_root or default_socket_root())
    return store, ""


def _adopt(cfg: RankConfig, digest: str, store: FdStore, count: Any) -> Outcome:
    transport = get_transport(cfg.transport)
    try:
        key = expected_key(cfg, digest, transport)
    except (PreloadGateError, OSError, ValueError) as exc:
        log.info("rank %d: no key before the fill (%s); not adopting", cfg.global_rank, exc)
        return Outcome(kind="key_unknown", why=f"no key before the fill: {exc}")
    if key is None:
        return Outcome(kind="key_unknown", why=f"the {cfg.stage} stage's key comes from vLLM's config built in "
                       "the rank's world, known only after the fill; only the raw stage adopts")
    try:
        return try_adopt(cfg, digest, store, transport, key, count)
    except FdStoreError as exc:
        log.warning("rank %d: the fd store failed a fetch (%s); loading from disk", cfg.global_rank, exc)
        return Outcome(kind="store_lost", why=f"the fd store failed a fetch: {exc}")


def _evict(store: FdStore | None, digest: str, global_rank: int, server: RankServer) -> None:
    """Take this rank's arena out of the store (a clean stop, a release)."""
    if store is None:  # lost and not replaced: nothing stored to take out
        return
    try:
        store.release(digest, global_rank)
    except FdStoreError as exc:
        log.warning("rank %d: could not take the arena out of the fd store: %s", global_rank, exc)
        return
    with server._mutex:
        server.stats.evicted += 1


def main() -> int:
    parent = ParentWatch()  # first: a launcher killed while this rank loads is seen too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def announce(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        cfg = RankConfig.from_json(json.loads(sys.stdin.readline()))
        if serve_rank(cfg, stop, announce, parent):
            return HANDED_OVER_EXIT
    except Exception as exc:
        # Out of descriptors (before the budget check could speak: an import,
        # a pipe, a socket): the limit is the whole story, in the launcher's
        # one line, with no traceback in the log.
        limit = None if isinstance(exc, PreloadGateError) else file_limit(exc)
        if not isinstance(exc, PreloadGateError) and limit is None:
            log.exception("rank failed")
        # A failure of the system's (no memory, no descriptor) is named by its cause.
        error = str(exc) if isinstance(exc, PreloadGateError) else limit.text if limit else reason(exc)
        announce({"event": "rank_error", "error": error, "type": type(exc).__name__})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
