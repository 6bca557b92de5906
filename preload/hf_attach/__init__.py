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

Modules, one concern each: :mod:`~preload.hf_attach.model` (the tensors
placed in the model :mod:`preload.meta_model` builds on meta), :mod:`~preload.hf_attach.ranks`
(which daemon serves this process), :mod:`~preload.hf_attach.attach`
(:func:`attach_model`), :mod:`~preload.hf_attach.disk` (a rank from disk),
:mod:`~preload.hf_attach.start` (:func:`load_rank`: events and the shared
decision).
"""

from __future__ import annotations

from preload.hf_attach.attach import MODES, AttachedModel, attach_model
from preload.hf_attach.disk import disk_model, disk_rank_tensors
from preload.hf_attach.model import (
    AttachError,
    build_tp_model,
    place_tensors,
    place_tp_tensors,
    tp_mesh,
)
from preload.hf_attach.ranks import RankMissError, daemon_gpus, find_rank
from preload.hf_attach.start import MISSES, load_rank
from preload.meta_model import build_meta_model

__all__ = [
    "MISSES",
    "MODES",
    "AttachError",
    "AttachedModel",
    "RankMissError",
    "attach_model",
    "build_meta_model",
    "build_tp_model",
    "daemon_gpus",
    "disk_model",
    "disk_rank_tensors",
    "find_rank",
    "load_rank",
    "place_tensors",
    "place_tp_tensors",
    "tp_mesh",
]
