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
from preload.errors import PreloadGateError, WeightCacheUnavailableError
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
    global_rank: int = 0,
) -> AttachedModel:
    """Build ``checkpoint``'s model on the meta device and attach the
    daemon's raw-stage tensors to it.

    The digest comes from ``identity`` (``stat``: the promoted manifest,
    ``pinned``: ``expected_digest``, ``full``: hash the shards), and picks
    the socket directory; ``socket_dir`` overrides that lookup.
    """
    from preload.daemon.raw import raw_key

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    digest = resolve_digest(checkpoint, identity, expected_digest).digest
    sdir = Path(socket_dir) if socket_dir else digest_socket_dir(digest, socket_root)
    seconds["identity"] = time.perf_counter() - t0
    transport = "cuda" if dev.type == "cuda" else "shm"
    key = raw_key(checkpoint, digest, transport)

    t1 = time.perf_counter()
    client = DaemonClient.connect(sdir, global_rank, client="preload-gate-hf")
    state: State | None = None
    attachment: Attachment | None = None
    try:
        state = client.get_state(key)
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
        verified=report, watch=watcher, attachment=attachment,
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
