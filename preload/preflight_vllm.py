"""The preflight checks whose rules are vLLM's: the dtype names it takes, its
choices for engine flags, how it splits layers over pipeline stages and
heads over tensor-parallel ranks. vLLM is asked where it is importable; the
rules are mirrored (and held equal by tests/cpu/test_preflight_vllm_rules.py)
where it is not. :mod:`preload.preflight` composes them with the checks of
our own (sockets, caches, ports).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from pgbase.errors import PreflightError

# The ``--dtype`` strings vLLM takes: "auto" and the keys of
# ``vllm.config.model._STR_DTYPE_TO_TORCH_DTYPE`` (its ``ModelDType``), compared
# lowercased as ``_get_and_verify_dtype`` does. Held equal to the installed
# vLLM by tests/cpu/test_preflight_vllm_rules.py.
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def check_dtype(dtype: str) -> None:
    """``dtype`` is one vLLM's ``--dtype`` takes (rule: vLLM's
    ``_get_and_verify_dtype``, which raises ``Unknown dtype`` for any other).

    Raises :class:`PreflightError` naming the accepted values."""
    if dtype.lower() not in VLLM_DTYPES:
        raise PreflightError(f"--dtype {dtype!r} is not a dtype vLLM takes; use one of {', '.join(VLLM_DTYPES)}")




@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM logs on import (Triton notes) and while it splits layers: a
    refusal must stay one line on stderr."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _vllm_choices(flag: str) -> tuple[str, ...] | None:
    """The values vLLM's own config takes for ``flag`` (its Literal types), or
    None where vLLM is not importable (nothing to check; vLLM decides later)."""
    from typing import get_args

    try:
        with _quiet():
            if flag == "--kv-cache-dtype":
                from vllm.config.cache import CacheDType

                return tuple(get_args(CacheDType))
            if flag == "--model-impl":
                from vllm.config.model import ModelImpl

                return tuple(get_args(ModelImpl))
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

            return tuple(QUANTIZATION_METHODS)
    except ImportError:
        return None


def check_engine_choices(engine: dict[str, object]) -> None:
    """``--kv-cache-dtype``, ``--quantization`` and ``--model-impl`` are values vLLM takes. vLLM
    is imported only for a value other than the default, so a plain start
    costs no import."""
    for flag, key, default in (("--kv-cache-dtype", "kv_cache_dtype", "auto"), ("--quantization", "quantization", None),
                               ("--model-impl", "model_impl", "auto")):
        value = engine.get(key)
        if value is None or value == default:
            continue
        choices = _vllm_choices(flag)
        if choices is not None and value not in choices:
            raise PreflightError(f"{flag} {value!r} is not one vLLM takes; use one of {', '.join(choices)}")


def check_pipeline_parallel(checkpoint: str | os.PathLike[str], pp_size: int) -> None:
    """Every pipeline stage holds at least one of the model's hidden layers,
    split as vLLM's ``get_pp_indices`` splits them (``VLLM_PP_LAYER_PARTITION``
    included) where vLLM is importable, evenly otherwise."""
    if pp_size <= 1:
        return
    from preload.identity.config import read_config

    cfg = read_config(checkpoint)
    if not isinstance(cfg, dict):
        return
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        cfg = text
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return
    with _quiet():
        try:
            from vllm.distributed.utils import get_pp_indices
        except ImportError:
            sizes = [layers // pp_size + (r < layers % pp_size) for r in range(pp_size)]
        else:
            try:
                sizes = [end - start for start, end in (get_pp_indices(layers, r, pp_size) for r in range(pp_size))]
            except ValueError as exc:
                raise PreflightError(f"--pipeline-parallel-size {pp_size}: {exc} (VLLM_PP_LAYER_PARTITION)") from None
    if min(sizes) < 1:
        raise PreflightError(f"--pipeline-parallel-size {pp_size} leaves a stage with no layer of the model's "
                             f"{layers} hidden layers (config.json; split {sizes}); choose at most {layers}")


def model_heads(checkpoint: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(num_attention_heads, num_key_value_heads)`` from the checkpoint's
    ``config.json`` (its ``text_config`` for a multimodal config, as vLLM's
    ``hf_text_config``; key/value heads default to the attention heads, as
    vLLM's ``get_total_num_kv_heads`` does). None when there is no
    ``config.json`` or it names no head count (nothing to check here; vLLM
    decides later). Reads one small file, no weights.

    Raises :class:`~pgbase.errors.CheckpointError` when ``config.json`` is not readable JSON."""
    from preload.identity.config import read_config

    cfg = read_config(checkpoint)
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    if "num_attention_heads" not in cfg and isinstance(text, dict):
        cfg = text
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        return None
    if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1:
        kv = heads
    return heads, kv


def _tp_fits(tp: int, heads: int, kv: int) -> bool:
    # vLLM's ModelConfig.verify_with_parallel_config: heads % tp == 0.
    # vLLM's QKVParallelLinear: KV heads are split when tp < kv (kv % tp == 0)
    # and replicated when tp >= kv (tp % kv == 0).
    return heads % tp == 0 and (kv % tp == 0 if tp < kv else tp % kv == 0)


def check_tensor_parallel(checkpoint: str | os.PathLike[str], tp_size: int) -> None:
    """``tp_size`` splits the model's attention and key/value heads the way
    vLLM can. Rules (vLLM's, not ours): ``ModelConfig.verify_with_parallel_config``
    refuses ``num_attention_heads % tensor_parallel_size != 0``; the attention
    layer (``QKVParallelLinear``) divides the key/value heads across ranks when
    there are more of them than ranks, and replicates them evenly otherwise,
    so ``num_key_value_heads % tp`` (or ``tp % num_key_value_heads``) must be 0.
    Held equal to the installed vLLM by tests/cpu/test_preflight_vllm_rules.py.

    Raises :class:`PreflightError` naming the head counts and the sizes that fit."""
    if tp_size < 1:
        return  # placement refuses it, with its own message
    counts = model_heads(checkpoint)
    if counts is None:
        return
    heads, kv = counts
    if _tp_fits(tp_size, heads, kv):
        return
    fits = [t for t in range(1, heads + 1) if _tp_fits(t, heads, kv)]
    what = (f"{heads} attention heads (config.json)" if heads % tp_size else
            f"{kv} key/value heads (config.json; vLLM splits them when tp < {kv}, replicates them when tp >= {kv})")
    raise PreflightError(f"--tensor-parallel-size {tp_size} does not fit the model's {what}; "
                         f"choose a tensor-parallel size from {fits}")
