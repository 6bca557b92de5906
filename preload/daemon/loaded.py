"""The ``loaded`` and ``processed`` stages: vLLM's own model, our byte proof.

The model is built with vLLM's machinery exactly as an engine rank builds it
(EngineArgs -> VllmConfig, a gloo/nccl world for TP/PP, the loader's
``create_model``, the model's ``load_weights`` with vLLM's strict
loaded-weights check), so the tensors held are laid out as the engine's.
The weights come from our iterator, which reads each shard once and hashes
every byte in the same pass.

``loaded`` (the CPU default) exports parameters and buffers BEFORE
``process_weights_after_loading``: on CPU processing packs weights into
opaque kernel handles, so the engine runs processing itself after attaching.
Each parameter's storage is swapped for its arena view before loading, so
``load_weights`` writes straight into the arena and weights are never held
twice. ``processed`` exports after processing (as vLLM does on CUDA),
copying tensor by tensor and freeing each original as it goes.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from pgbase.dtypes import check_header
from pgbase.errors import CheckpointError, PreloadGateError
from pgbase.shards import check_unique_tensors, read_header, shard_paths
from preload.budget import check_memory, rank_open_files, reserve_open_files
from preload.checksum import resident_checksums
from preload.daemon.proof import ProvenShard, check_digest, torch_dtype, torch_shape
from preload.daemon.server import MAX_CONNECTIONS
from preload.daemon.stage import Filled, RankConfig, create_arena, rss_bytes
from preload.identity.manifest import Manifest
from preload.transports.base import Layout, Transport

log = logging.getLogger("preload.daemon")


class ProvenWeights:
    """``(name, tensor)`` for every tensor of every shard, each shard read
    once in file order and hashed in that pass; ``drain()`` reads whatever a
    model's ``load_weights`` did not consume, so every byte is proven."""

    def __init__(self, checkpoint: str) -> None:
        self.paths = shard_paths(checkpoint)
        headers = [read_header(p) for p in self.paths]
        # A tensor in two files resolves by directory order in vLLM: refused.
        check_unique_tensors(headers)
        # Every dtype checked against the shared table (pgbase.dtypes) before
        # the first weight byte: one torch has no type for is refused here.
        for h in headers:
            check_header(h)
        self.digests: dict[str, str] = {}
        self.bytes_read = 0
        # Arena views a checkpoint tensor can be read straight into (same name,
        # shape and dtype as a parameter): no temporary copy of those weights.
        self.direct: dict[str, torch.Tensor] = {}
        self.direct_reads = 0
        self._it = self._iterate()

    def _iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.paths:
            shard = ProvenShard(path)
            try:
                for info in shard.tensors:
                    target = self.direct.get(info.name)
                    if target is not None and target.dtype == torch_dtype(info, shard.name) \
                            and tuple(target.shape) == torch_shape(info, shard.name):
                        shard.read_into(info, target)
                        self.direct_reads += 1
                        # The weight loader copies it onto itself (a no-op).
                        yield info.name, target
                        continue
                    yield info.name, shard.read_tensor(info)
                self.digests[shard.name] = shard.finish()
                self.bytes_read += shard.size
            finally:
                shard.close()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._it

    def drain(self) -> dict[str, str]:
        for _ in self._it:
            pass
        return self.digests


def _canonical_tensors(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor, str]], dict[str, str]]:
    """Every parameter and buffer once (``remove_duplicate=False``), plus the
    alias map of tied names to the canonical name of the same tensor."""
    out: list[tuple[str, torch.Tensor, str]] = []
    aliases: dict[str, str] = {}
    by_id: dict[int, str] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if id(t) in by_id:
                if by_id[id(t)] != name:
                    aliases[name] = by_id[id(t)]
                continue
            by_id[id(t)] = name
            if not t.is_contiguous():
                raise PreloadGateError(f"tensor {name} is not contiguous; it cannot be placed in an arena")
            out.append((name, t, kind))
    return out, aliases


def _plan(tensors: list[tuple[str, torch.Tensor, str]]) -> Layout:
    return Layout.plan([(n, t.dtype, tuple(t.shape), kind) for n, t, kind in tensors])


def build_vllm_config(cfg: RankConfig) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    eng = cfg.engine
    if int(eng.get("dp_size", 1)) > 1 and eng.get("enable_expert_parallel"):
        raise PreloadGateError("expert-parallel DP daemons are not supported by this build; use DP=1")
    args = EngineArgs(
        model=cfg.checkpoint,
        tensor_parallel_size=int(eng.get("tp_size", 1)),
        pipeline_parallel_size=int(eng.get("pp_size", 1)),
        dtype=eng.get("dtype") or "auto",
        max_model_len=eng.get("max_model_len"),  # type: ignore[arg-type]
        quantization=eng.get("quantization"),
        kv_cache_dtype=eng.get("kv_cache_dtype") or "auto",
        enable_expert_parallel=bool(eng.get("enable_expert_parallel")),
        model_impl=str(eng.get("model_impl") or "auto"),
        enforce_eager=True,
        load_format="auto",
        distributed_executor_backend="mp",
    )
    return args.create_engine_config()


def fill_model(cfg: RankConfig, transport: Transport, expected: str | None, manifest: Manifest | None) -> Filled:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    from preload.vllm_key import key_from_vllm

    start = time.perf_counter()
    vllm_config = build_vllm_config(cfg)
    model_config = vllm_config.model_config
    par = vllm_config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if cfg.distributed_init_method is None:
        raise PreloadGateError("a loaded-stage rank needs a distributed init method")
    # vLLM's CPU communicator names its shared-memory group by this, as the
    # CPU worker sets it: one name per daemon group (its rendezvous port).
    os.environ.setdefault("VLLM_DIST_IDENT", "pgd" + cfg.distributed_init_method.rsplit(":", 1)[-1])
    init_distributed_environment(
        world_size=tp * pp,
        rank=cfg.pp_rank * tp + cfg.tp_rank,
        distributed_init_method=cfg.distributed_init_method,
        local_rank=cfg.local_rank,
        backend=current_platform.dist_backend,
    )
    device = torch.device(vllm_config.device_config.device if vllm_config.device_config.device else "cpu")
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(tp, pp)
        # The key before loading: processing may mutate the quantization config.
        key = key_from_vllm(
            vllm_config, "0" * 64, tp_size=tp, tp_rank=cfg.tp_rank, pp_size=pp, pp_rank=cfg.pp_rank,
            dp_size=int(cfg.engine.get("dp_size", 1)), dp_rank=cfg.dp_rank,
            export_stage=cfg.stage, transport=transport.name,
        )
        loader: Any = get_model_loader(dataclasses.replace(vllm_config.load_config, load_format="auto"))
        # vLLM is up (its world, its files): what the load opens from here is
        # ours, one shard at a time (preload.budget); checked before the first.
        need, want = rank_open_files(MAX_CONNECTIONS, cfg.stage)
        reserve_open_files(need, f"the {cfg.stage} stage (shards read one at a time)", want)
        weights = ProvenWeights(cfg.checkpoint)
        loader.get_all_weights = lambda _mc, _m: weights
        loader.counter_before_loading_weights = time.perf_counter()
        # vLLM's imports and config are behind us: what grows from here is weights.
        baseline_rss = rss_bytes()
        free_before = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 0
        with set_default_torch_dtype(model_config.dtype):
            with device:
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
            if cfg.stage == "loaded":
                arena, layout, aliases, checksums = _load_into_arena(model, loader, model_config, transport, weights)
            else:
                # The model is allocated on its device already; its arena copy
                # comes beside it, checked before the first weight is read.
                held = sum(t.numel() * t.element_size() for _n, t, _k in _canonical_tensors(model)[0])
                check_memory([("the processed stage's arena copy of the model", held)],
                             device=transport.memory_device())
                loader.load_weights(model, model_config)
                process_weights_after_loading(model, model_config, device)
                arena, layout, aliases, checksums = _copy_into_arena(model, transport)
    try:
        digests = weights.drain()
        digest = check_digest(digests, expected, manifest)
    except BaseException:
        arena.close()
        raise
    del model
    gc.collect()
    held = returned = 0
    if device.type == "cuda":
        returned = _return_cached_blocks(layout.total_bytes)
        held = free_before - torch.cuda.mem_get_info()[0]
        log.info("processed stage: this rank holds %d device bytes for %d bytes of weights (%.3fx)",
                 held, layout.total_bytes, held / max(1, layout.total_bytes))
    arena.seal()
    return Filled(
        arena=arena, layout=layout, key=dataclasses.replace(key, content_digest=digest), digest=digest,
        stage=cfg.stage, aliases=aliases, shard_digests=digests, checksums=checksums,
        load_seconds=time.perf_counter() - start, bytes_read=weights.bytes_read,
        baseline_rss_bytes=baseline_rss, device_bytes_held=held, device_cache_returned=returned,
    )


def _return_cached_blocks(arena_bytes: int) -> int:
    """Give the processed model's freed tensors back to the driver.

    ``_release`` frees the model's own tensors once they are copied into the
    arena, but torch's caching allocator keeps their blocks reserved for
    reuse: the daemon then holds the weights twice on the GPU (measured on an
    H200: 16,367 MiB for 7.68 GiB of weights, against 8,619 MiB for vLLM's
    own daemon). The arena is a VMM allocation outside that cache, so
    ``empty_cache`` leaves the daemon holding the arena, its CUDA context and
    vLLM's communicator buffers. Returns the bytes given back."""
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    log.info("processed stage: arena %d bytes; torch's cache %d -> %d bytes reserved (allocated %d)",
             arena_bytes, before, after, torch.cuda.memory_allocated())
    return before - after


def _plain_copy_loader(param: torch.Tensor) -> bool:
    """A parameter whose weight loader copies a same-shaped tensor unchanged
    (vLLM's default loader, or none); only those may be read in place."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    fn = getattr(param, "weight_loader", default_weight_loader)
    # The embedding's loader narrows to this rank's vocab shard and copies: with
    # an equal shape that shard is the whole tensor, a copy onto itself.
    return fn is default_weight_loader or getattr(fn, "__func__", None) is VocabParallelEmbedding.weight_loader


def _check_arena_fits(layout: Layout, transport: Transport, stage: str) -> None:
    check_memory([(f"the {stage} stage's arena ({len(layout.entries)} tensors)", layout.total_bytes)],
                 device=transport.memory_device())


def _load_into_arena(model: torch.nn.Module, loader: Any, model_config: Any, transport: Transport,
                     weights: ProvenWeights) -> Any:
    tensors, aliases = _canonical_tensors(model)
    layout = _plan(tensors)
    _check_arena_fits(layout, transport, "loaded")  # before the first tensor is read
    arena = create_arena(transport, layout)
    views = arena.views()
    try:
        for name, t, kind in tensors:
            v = views[name]
            if kind == "buffer":
                v.copy_(t.data)  # buffers (rotary caches) carry values from init
            t.data = v  # load_weights now writes into the arena
            if kind == "param" and _plain_copy_loader(t):
                weights.direct[name] = v
        try:
            loader.load_weights(model, model_config)
        finally:
            weights.direct.clear()  # its views pin the writable mapping
        log.info("read %d tensors straight into the arena", weights.direct_reads)
        for name, t, _kind in tensors:
            if t.data_ptr() != views[name].data_ptr():
                # A weight loader rebound .data instead of copying: keep its value.
                log.debug("tensor %s was rebound during loading; copying it into the arena", name)
                views[name].copy_(t.data)
    except BaseException:
        _release(tensors)
        del views
        arena.close()
        raise
    checksums = resident_checksums(arena, views)
    _release(tensors)
    del views
    return arena, layout, aliases, checksums


def _copy_into_arena(model: torch.nn.Module, transport: Transport) -> Any:
    tensors, aliases = _canonical_tensors(model)
    layout = _plan(tensors)
    _check_arena_fits(layout, transport, "processed")  # beside the processed model it copies
    arena = create_arena(transport, layout)
    views = arena.views()
    for name, t, _kind in tensors:
        views[name].copy_(t.data)
    checksums = resident_checksums(arena, views)
    _release(tensors)
    del views
    return arena, layout, aliases, checksums


def _release(tensors: list[tuple[str, torch.Tensor, str]]) -> None:
    """Drop every model reference into the arena (modules may outlive us in
    vLLM's forward context), so the writable mapping can be closed."""
    for _name, t, _kind in tensors:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    tensors.clear()
    gc.collect()


__all__ = ["CheckpointError", "ProvenWeights", "fill_model"]
