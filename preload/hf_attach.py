"""A transformers model whose weights are the daemon's, not a disk load.

The ``raw`` stage serves a checkpoint's tensors under their checkpoint
names, so any consumer that names parameters the way the checkpoint does
can attach them without vLLM: build the model from ``config.json`` with
parameters on the meta device (no memory, no init), put the daemon's
tensors in their place, tie weights, move the small computed buffers
(rotary frequencies) to the device. The result decodes exactly like
``from_pretrained`` on the same checkpoint.

>>> attached = attach_model("/models/llama", device="cuda:0")    # doctest: +SKIP
>>> attached.model.generate(ids, max_new_tokens=16, do_sample=False)  # doctest: +SKIP
>>> attached.close()                                            # doctest: +SKIP

``mode="zero_copy"`` keeps the daemon's memory (and a ``watch`` connection
whose close signals daemon loss); ``mode="copy"`` clones every tensor, then
asks the daemon to release its arena. ``verify_resident`` checks every
tensor against the checksums the daemon took after loading, so weights an
earlier zero-copy engine wrote into are refused, not served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from preload.checksum import VerifyReport, verify_resident
from preload.client import DaemonClient, State, Watch
from preload.errors import (
    CacheKeyMismatchError,
    PreloadGateError,
    ProtocolError,
    WeightCacheUnavailableError,
)
from preload.identity.manifest import resolve_digest
from preload.sockets import socket_dir as digest_socket_dir
from preload.transports.base import Attachment

log = logging.getLogger("preload.hf_attach")
MODES = ("zero_copy", "copy")


class AttachError(PreloadGateError):
    """The daemon's tensors do not fit the model built from the config."""


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


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Register every new parameter on the meta device; buffers stay real.

    Rotary frequencies and similar buffers are computed in ``__init__`` and
    are not in the checkpoint, so they must be built for real; parameters
    come from the daemon and must not be allocated or initialised at all.
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            assert p is not None
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_meta_model(checkpoint: str | os.PathLike[str]) -> Any:
    """The checkpoint's model class from its config, parameters on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(checkpoint))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with _meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # from_pretrained decodes with generation_config.json when there is one
    # (its eos/bos ids steer min_new_tokens and stopping); so must we.
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(checkpoint))
    except OSError:
        pass
    return model.eval()


def place_tensors(model: Any, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> None:
    """Put ``tensors`` (checkpoint names) in place of the model's meta
    parameters, tie weights, and check nothing is left on meta."""
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unexpected = sorted(n for n in tensors if n not in named and n not in buffers)
    if unexpected:
        raise AttachError(
            f"the daemon serves {len(unexpected)} tensors this model has no place for "
            f"({', '.join(unexpected[:5])}); is the daemon serving this checkpoint at stage raw?"
        )
    for name, tensor in {**tensors, **{a: tensors[c] for a, c in (aliases or {}).items() if c in tensors}}.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            expect = owner._parameters[leaf]
            if tuple(expect.shape) != tuple(tensor.shape):
                raise AttachError(
                    f"tensor {name}: the daemon serves shape {tuple(tensor.shape)}, "
                    f"the model built from config.json wants {tuple(expect.shape)}"
                )
            owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor
    tie = getattr(model, "tie_weights", None)  # transformers models; a plain nn.Module has none
    if tie is not None:
        tie()
    left = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta)
    if left:
        raise AttachError(
            f"{len(left)} parameters got no tensor from the daemon ({', '.join(left[:5])}); "
            "the checkpoint lacks them and they are not tied"
        )


class RankMissError(WeightCacheUnavailableError):
    """This engine rank found no daemon serving it: names the rank and the key fields."""

    def __init__(self, rank: int, fields: list[str], detail: str) -> None:
        self.rank = rank
        self.fields = list(fields)
        super().__init__(f"rank {rank}: {detail}" + (f" (fields: {', '.join(self.fields)})" if self.fields else ""))


def daemon_gpus(sdir: str | os.PathLike[str]) -> dict[int, str | None]:
    """Each serving rank in ``sdir`` and the GPU (UUID) its arena lives on,
    from the daemons' own hello; ranks that do not answer are left out."""
    out: dict[int, str | None] = {}
    for rank in _socket_ranks(Path(sdir)):
        try:
            c = DaemonClient.connect(sdir, rank, client="preload-gate-hf-probe")
        except (WeightCacheUnavailableError, ProtocolError):
            continue
        try:
            uuid = c.hello.get("gpu_uuid")
            out[rank] = uuid if isinstance(uuid, str) else None
        finally:
            c.close()
    return out


def _socket_ranks(sdir: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("rank")) for p in sdir.glob("rank*.sock")
                  if p.stem.removeprefix("rank").isdigit())


def find_rank(sdir: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0) -> int:
    """The global rank whose daemon holds this engine rank's weights.

    On CUDA: the daemon on this process's own physical GPU, matched by UUID
    (``CUDA_VISIBLE_DEVICES`` renumbers indices per process, so an index
    says nothing about which GPU it is). On CPU: the TP rank (first DP replica).
    """
    from preload.daemon.placement import rank_on_gpu

    if device.type != "cuda":
        return tp_rank
    from preload.transports.cuda import device_uuid

    index = device.index if device.index is not None else torch.cuda.current_device()
    own = device_uuid(index)
    gpus = daemon_gpus(sdir)
    g = rank_on_gpu(gpus, own, tp_size, tp_rank)
    if g is None:
        seen = ", ".join(f"rank{r}={u}" for r, u in sorted(gpus.items())) or "none answering"
        raise RankMissError(tp_rank, ["gpu_uuid"], f"no daemon in {sdir} serves tensor-parallel rank {tp_rank} "
                            f"on this engine's GPU cuda:{index} ({own}); daemons: {seen}; start "
                            "preload-gate preload on this GPU, or run this rank on its daemon's GPU")
    return g


def _bind_device(device: str | torch.device) -> torch.device:
    """The device with its index made explicit; a CUDA device becomes current."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"tp_size={tp_size} needs torch.distributed initialised (torchrun, one process per rank)")
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tp_size={tp_size}, but the process group has {dist.get_world_size()} ranks")
    return int(dist.get_rank())


def tp_mesh(device: torch.device, tp_size: int) -> Any:
    """The 1-D device mesh a ``tp_size``-way transformers engine shards on
    (what ``from_pretrained(tp_plan="auto")`` builds: the whole world)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (tp_size,))


def build_tp_model(checkpoint: str | os.PathLike[str], mesh: Any, tp_size: int) -> Any:
    """The meta model with transformers' own tensor-parallel plan applied:
    its parameters become DTensor placeholders (placements as transformers
    sets them) and its modules get transformers' forward hooks."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model = build_meta_model(checkpoint)
    apply_tensor_parallelism(model, mesh)
    model._device_mesh = mesh
    model._tp_size = tp_size
    try:
        from transformers.distributed import DistributedConfig

        model.config.distributed_config = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    except (ImportError, TypeError, ValueError):
        pass
    return model


def place_tp_tensors(model: Any, tensors: dict[str, torch.Tensor], mesh: Any, tp_size: int, tp_rank: int) -> None:
    """Put this rank's slices where transformers' placeholders are: a
    sharded parameter becomes ``DTensor.from_local`` of our slice with the
    placeholder's own placements, global shape and stride. A slice whose
    split differs from the placeholder's is refused by name."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from preload.daemon.tp_slice import chunk

    named = dict(model.named_parameters(remove_duplicate=False))
    unexpected = sorted(n for n in tensors if n not in named)
    if unexpected:
        raise AttachError(f"the daemon serves {len(unexpected)} tensors this model has no place for "
                          f"({', '.join(unexpected[:5])})")
    for name, local in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        expect = owner._parameters[leaf]
        if isinstance(expect, DTensor):
            placements = tuple(expect.placements)
            if len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
                raise AttachError(f"tensor {name}: transformers places it as {placements}; only Shard/Replicate "
                                  "can be served from the raw stage")
            pl = placements[0]
            want = tuple(expect.shape) if isinstance(pl, Replicate) else tuple(
                chunk(torch.empty(tuple(expect.shape), device="meta"), pl.dim, tp_size, tp_rank).shape)
            if tuple(local.shape) != want:
                raise AttachError(f"tensor {name}: the daemon serves a slice of shape {tuple(local.shape)}; "
                                  f"transformers places it as {pl} of {tuple(expect.shape)}, rank {tp_rank} "
                                  f"holds {want}: the daemon and this engine split differently")
            value: torch.Tensor = DTensor.from_local(local, mesh, placements, run_check=False,
                                                     shape=expect.shape, stride=expect.stride())
        else:
            if tuple(expect.shape) != tuple(local.shape):
                raise AttachError(f"tensor {name}: the daemon serves shape {tuple(local.shape)}, "
                                  f"the model wants {tuple(expect.shape)} (replicated on every rank)")
            value = local
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    left = sorted(n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta)
    if left:
        raise AttachError(f"{len(left)} parameters got no tensor from the daemon ({', '.join(left[:5])})")


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
    dev = _bind_device(device)
    tp_rank = _tp_rank(tp_size)
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
    client = _connect_rank(sdir, global_rank, tp_rank, key)
    state: State | None = None
    attachment: Attachment | None = None
    try:
        try:
            state = client.get_state(key)
        except CacheKeyMismatchError as exc:
            raise RankMissError(tp_rank, exc.fields, f"the daemon of global rank {global_rank} in {sdir} "
                                "holds another key") from exc
        attachment = state.attach()
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
        if mode == "copy":
            del tensors
            attachment.close()
            attachment = None
            client.release()
    except BaseException:
        if attachment is not None:
            attachment.close()
        if state is not None:
            state.close()
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


def _connect_rank(sdir: Path, global_rank: int, tp_rank: int, key: Any) -> DaemonClient:
    """Connect to ``global_rank``'s daemon; a missing rank is a RankMissError
    naming the key fields a sibling daemon of the same digest differs on."""
    try:
        return DaemonClient.connect(sdir, global_rank, client="preload-gate-hf")
    except WeightCacheUnavailableError as exc:
        others = [r for r in _socket_ranks(sdir) if r != global_rank]
        fields: list[str] = []
        for r in others[:1]:
            try:
                c = DaemonClient.connect(sdir, r, client="preload-gate-hf-probe")
            except (WeightCacheUnavailableError, ProtocolError):
                break
            try:
                c.get_state(key).close()
            except CacheKeyMismatchError as mis:
                fields = mis.fields
            except (WeightCacheUnavailableError, ProtocolError):
                pass
            finally:
                c.close()
        where = f"daemons of this digest serve ranks {others}" if others else "no daemon serves this digest"
        raise RankMissError(tp_rank, fields, f"no daemon for global rank {global_rank} in {sdir}: {where}") from exc


def _checksums(state: State) -> dict[str, str]:
    sums = getattr(state, "checksums", None)
    if not sums:
        raise WeightCacheUnavailableError(
            "verify_resident was asked for, but the daemon sent no resident checksums "
            "(a sealed arena such as shm needs none; an older daemon sends none); "
            "attach with verify=False to skip the check knowingly"
        )
    return dict(sums)


def disk_rank_tensors(
    checkpoint: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's tensors read from the checkpoint's shards, split by the
    same rule the daemon uses (``preload.daemon.tp_slice``): a fallback
    rank holds exactly what its daemon would have served."""
    from safetensors import safe_open

    from preload.daemon.tp_slice import chunk, plan_slices
    from preload.identity.shards import shard_paths

    out: dict[str, torch.Tensor] = {}
    for path in shard_paths(checkpoint):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            slices = plan_slices(checkpoint, [(n, f.get_slice(n).get_shape()) for n in names], tp_size, tp_rank)
            for n in names:
                full = f.get_tensor(n)
                sl = slices[n]
                part = full if sl.dim is None else chunk(full, sl.dim, tp_size, tp_rank)
                out[n] = part.contiguous().to(device)
    return out


def disk_model(
    checkpoint: str | os.PathLike[str], device: torch.device, tp_size: int = 1, tp_rank: int = 0, mesh: Any = None
) -> Any:
    """The same model as :func:`attach_model` builds, weights from disk
    (this rank only: no collective, so other ranks may stay attached)."""
    tensors = disk_rank_tensors(checkpoint, device, tp_size, tp_rank)
    if tp_size > 1:
        model = build_tp_model(checkpoint, mesh, tp_size)
        place_tp_tensors(model, tensors, mesh, tp_size, tp_rank)
    else:
        model = build_meta_model(checkpoint)
        place_tensors(model, tensors)
    return model.to(device)


def _ranks_that_missed(missed: bool, tp_size: int, tp_rank: int, device: torch.device) -> list[int]:
    """Every rank learns which ranks missed (one all-reduce of a flag per rank)."""
    if tp_size == 1:
        return [0] if missed else []
    import torch.distributed as dist

    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = torch.zeros(tp_size, dtype=torch.int32, device=where)
    flags[tp_rank] = int(missed)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


MISSES = (WeightCacheUnavailableError, CacheKeyMismatchError, AttachError, ProtocolError)


def load_rank(
    checkpoint: str | os.PathLike[str],
    *,
    fallback: bool = False,
    events_file: str | None = None,
    device: str | torch.device = "cuda",
    tp_size: int = 1,
    **attach: Any,
) -> AttachedModel:
    """:func:`attach_model` as an engine start: exactly one load event per
    rank (``preload.events``), and a decision all ranks share.

    A rank whose daemon is missing or holds another key is a miss naming
    the rank and the key fields. With ``fallback`` off the whole start fails
    on every rank (AttachError), also on ranks that attached; with it on,
    that rank loads its own slices from disk (``source: "disk"`` in its
    event) and the others keep the daemon's weights.
    """
    from preload.events import LoadEvent, emit

    dev = _bind_device(device)
    tp_rank = _tp_rank(tp_size)
    mesh = tp_mesh(dev, tp_size) if tp_size > 1 else None
    t0 = time.perf_counter()
    attached: AttachedModel | None = None
    miss: Exception | None = None
    try:
        attached = attach_model(checkpoint, device=dev, tp_size=tp_size, mesh=mesh, **attach)
    except Exception as exc:  # every rank must reach the all-reduce below, whatever failed
        miss = exc
    missed = _ranks_that_missed(miss is not None, tp_size, tp_rank, dev)
    if miss is not None and not isinstance(miss, MISSES):
        emit(LoadEvent("error", f"rank {tp_rank}: {type(miss).__name__}: {miss}", rank=tp_rank,
                       seconds=time.perf_counter() - t0), events_file)
        raise miss
    mode = str(attach.get("mode", "zero_copy"))
    if attached is not None:
        event = LoadEvent("hit", "attached", digest=attached.digest, daemon_digest=attached.daemon_digest,
                          mode=mode, tensors=attached.tensors, bytes=attached.bytes, rank=tp_rank,
                          source="daemon")
        if missed and not fallback:
            attached.close()
            event.outcome, event.source = "error", "none"
            event.reason = f"ranks {missed} missed and fallback is off: the whole start fails"
            event.seconds = time.perf_counter() - t0
            emit(event, events_file)
            raise AttachError(f"rank {tp_rank}: {event.reason}")
        event.seconds = time.perf_counter() - t0
        emit(event, events_file)
        return attached
    assert miss is not None
    fields = list(getattr(miss, "fields", []) or [])
    reason = str(miss) if str(miss).startswith(f"rank {tp_rank}") else f"rank {tp_rank}: {miss}"
    event = LoadEvent("miss", reason, fields=fields, mode=mode, rank=tp_rank, source="none")
    if not fallback:
        event.seconds = time.perf_counter() - t0
        emit(event, events_file)
        raise AttachError(f"{reason}; fallback is off: the whole start fails") from miss
    model = disk_model(checkpoint, dev, tp_size, tp_rank, mesh)
    event.source = "disk"
    event.reason = reason + "; loaded this rank from disk (fallback)"
    event.tensors = sum(1 for _ in model.parameters())
    event.seconds = time.perf_counter() - t0
    emit(event, events_file)
    return AttachedModel(model=model, digest="", mode=mode, tensors=event.tensors, bytes=0, rank=tp_rank,
                         source="disk")
