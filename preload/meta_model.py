"""A checkpoint's transformers model built from ``config.json`` on the meta device.

Two places need the model without its weights: the raw stage's
tensor-parallel split reads the model's plan from it
(:mod:`preload.daemon.tp_slice`), and :mod:`preload.hf_attach` puts the
daemon's tensors into it. Both import it from here, so the daemon never
imports its consumer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


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
