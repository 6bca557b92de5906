"""Attach a daemon's raw-stage tensors to a transformers model: :func:`attach_model`.

Resolves the checkpoint's digest, connects to the rank's daemon, attaches
the arena, checks the resident checksums, and builds the model over the
tensors (:mod:`preload.hf_attach.model`); ``copy`` mode clones and lets the
daemon release, ``zero_copy`` keeps the mapping and a loss watch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pgbase.errors import CacheKeyMismatchError, WeightCacheUnavailableError
from preload.checksum import ResidentWeightsChangedError, VerifyReport, verify_resident
from preload.client import State, Watch
from preload.hf_attach.model import (
    build_tp_model,
    place_tensors,
    place_tp_tensors,
    tp_mesh,
)
from preload.hf_attach.ranks import (
    RankMissError,
    bind_device,
    connect_rank,
    find_rank,
    process_tp_rank,
)
from preload.identity.manifest import resolve_digest
from preload.loader.options import MODES
from preload.meta_model import build_meta_model
from preload.sockets import socket_dir as digest_socket_dir
from preload.transports.base import Attachment

log = logging.getLogger("preload.hf_attach")  # the package's name, not this submodule's


@dataclass
class AttachedModel:
    """A model running on attached weights, and what keeps them alive."""

    model: Any
    digest: str
    mode: str
    tensors: int
    bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    verified: VerifyReport | None = None
    watch: Watch | None = None
    attachment: Attachment | None = None
    rank: int = 0
    global_rank: int | None = None
    daemon_digest: str | None = None
    # "daemon" (attached) or "disk" (a fallback: load_rank with fallback on).
    source: str = "daemon"

    @property
    def daemon_lost(self) -> bool:
        return self.watch is not None and self.watch.lost.is_set()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.attachment is not None:
            self.attachment.close()
            self.attachment = None


def attach_model(
    checkpoint: str | os.PathLike[str],
    *,
    device: str | torch.device = "cuda",
    mode: str = "zero_copy",
    socket_root: str | os.PathLike[str] | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    identity: str = "stat",
    expected_digest: str | None = None,
    verify: bool = True,
    watch: bool = True,
    on_loss: Callable[[], None] | None = None,
    global_rank: int | None = None,
    tp_size: int = 1,
    mesh: Any = None,
) -> AttachedModel:
    """Build ``checkpoint``'s model on the meta device and attach the
    daemon's raw-stage tensors to it.

    The digest comes from ``identity`` (``stat``: the promoted manifest,
    ``pinned``: ``expected_digest``, ``full``: hash the shards), and picks
    the socket directory; ``socket_dir`` overrides that lookup.
    ``global_rank`` None (the default) attaches the daemon on this process's
    own GPU, found by UUID (:func:`find_rank`). ``tp_size > 1``: one call per
    process of a torch.distributed group of that size; each attaches its
    rank's slices and gets transformers' tensor-parallel model over them.
    """
    from preload.daemon.raw import raw_key

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    dev = bind_device(device)
    tp_rank = process_tp_rank(tp_size)
    if tp_size > 1 and mesh is None:
        mesh = tp_mesh(dev, tp_size)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    digest = resolve_digest(checkpoint, identity, expected_digest).digest
    sdir = Path(socket_dir) if socket_dir else digest_socket_dir(digest, socket_root)
    seconds["identity"] = time.perf_counter() - t0
    transport = "cuda" if dev.type == "cuda" else "shm"
    key = raw_key(checkpoint, digest, transport, tp_size, tp_rank)

    t1 = time.perf_counter()
    if global_rank is None:
        global_rank = find_rank(sdir, dev, tp_size, tp_rank)
    client = connect_rank(sdir, global_rank, tp_rank, key)
    state: State | None = None
    attachment: Attachment | None = None
    reported = False
    try:
        try:
            state = client.get_state(key)
        except CacheKeyMismatchError as exc:
            raise RankMissError(tp_rank, exc.fields, f"the daemon of global rank {global_rank} in {sdir} "
                                "holds another key") from exc
        # This model only reads its weights (copy mode clones them): map read-only.
        attachment = state.attach(writable=False)
        seconds["attach"] = time.perf_counter() - t1
        report = None
        if verify:
            t2 = time.perf_counter()
            report = verify_resident(attachment.tensors, state.layout, _checksums(state))
            seconds["verify"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        tensors = attachment.tensors
        if mode == "copy":
            tensors = {n: t.clone() for n, t in tensors.items()}
        if tp_size > 1:
            model = build_tp_model(checkpoint, mesh, tp_size)
            place_tp_tensors(model, tensors, mesh, tp_size, tp_rank)
        else:
            model = build_meta_model(checkpoint)
            place_tensors(model, tensors, state.aliases)
        model.to(dev)  # only the computed buffers move; parameters are already there
        seconds["build"] = time.perf_counter() - t3
        n_bytes = state.layout.total_bytes
        n_tensors = len(state.layout.entries)
        reported = client.report_attach()  # the daemon counts the hit now
        if mode == "copy":
            del tensors
            attachment.close()
            attachment = None
            client.release()
    except BaseException as exc:
        if attachment is not None:
            attachment.close()
        if state is not None:
            state.close()
            if not reported and isinstance(exc, Exception):  # else the daemon counts the close
                kind = "verify" if isinstance(exc, ResidentWeightsChangedError) else "attach"
                client.report_attach(False, kind, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        client.close()
    watcher = None
    if mode == "zero_copy" and watch:
        watcher = Watch.open(sdir, global_rank, on_loss or (lambda: log.warning(
            "preload-gate: the daemon serving %s... went away; attached weights stay mapped "
            "but the next restart will not find it", digest[:16])))
    return AttachedModel(
        model=model, digest=digest, mode=mode, tensors=n_tensors, bytes=n_bytes, seconds=seconds,
        verified=report, watch=watcher, attachment=attachment, rank=tp_rank, global_rank=global_rank,
        daemon_digest=state.digest,
    )


def _checksums(state: State) -> dict[str, str]:
    sums = getattr(state, "checksums", None)
    if not sums:
        raise WeightCacheUnavailableError(
            "verify_resident was asked for, but the daemon sent no resident checksums "
            "(a sealed arena such as shm needs none; an older daemon sends none); "
            "attach with verify=False to skip the check knowingly"
        )
    return dict(sums)
