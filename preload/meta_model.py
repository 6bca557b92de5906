"""A checkpoint's transformers model built from ``config.json`` on the meta device.

Two places need the model without its weights: the raw stage's
tensor-parallel split reads the model's plan from it
(:mod:`preload.daemon.tp_slice`), and :mod:`preload.hf_attach` puts the
daemon's tensors into it. Both import it from here, so the daemon never
imports its consumer.

Parameters go to the meta device, buffers stay real: rotary frequencies and
similar buffers are computed in ``__init__`` and are not in the checkpoint,
so they must be built for real, while parameters come from the daemon and
must not be allocated or initialised at all. That split is accelerate's
``init_empty_weights(include_buffers=False)``, so it is used rather than a
patch of our own. torch's ``with torch.device("meta"):`` (a TorchFunctionMode,
no global patch) was the other candidate and is not enough: it sends every
tensor created inside, buffers included, to meta, and a rotary ``inv_freq``
on meta has no values to attach or compute with.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pgbase.oscause import file_limit


def build_meta_model(checkpoint: str | os.PathLike[str]) -> Any:
    """The checkpoint's model class from its config, parameters on meta.

    Needs transformers and accelerate (the ``cpu``, ``gpu`` and ``hf``
    extras); ImportError without them.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(checkpoint))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # include_buffers stated: its default reads ACCELERATE_INIT_INCLUDE_BUFFERS.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # from_pretrained decodes with generation_config.json when there is one
    # (its eos/bos ids steer min_new_tokens and stopping); so must we.
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(checkpoint))
    except OSError as exc:
        if file_limit(exc) is not None:
            raise  # not "no generation_config.json": decoding would quietly differ
    return model.eval()
