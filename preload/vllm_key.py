"""Build a :class:`WeightCacheKey` from vLLM's configs (daemon and engine alike).

Both sides call :func:`key_from_vllm` with their own configs, before weight
loading: ``process_weights_after_loading`` may mutate the quantization
config. Only this module and the loader/daemon stages import vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from preload.engine_platform import for_device
from preload.identity.config import config_digest
from preload.identity.key import WeightCacheKey
from preload.transports.base import dtype_name


def _digest(obj: Any) -> str | None:
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _rope(hf_config: Any) -> dict[str, Any] | None:
    # max_position_embeddings sizes the cached rotary buffers (vLLM 0.33 keys it too).
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    rope = {k: getattr(hf_config, k, None) for k in keys}
    rope = {k: v for k, v in rope.items() if v is not None}
    return rope or None


def _quant(hf_config: Any, model_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization config and the runtime one (``--hf-overrides``
    or ``quantization_config`` engine args), as vLLM 0.33 keys both."""
    ckpt: Any = getattr(hf_config, "quantization_config", None)
    if ckpt is not None and hasattr(ckpt, "to_dict"):
        ckpt = ckpt.to_dict()
    runtime = getattr(model_config, "quantization_config", None)
    if ckpt is None and runtime is None:
        return None
    return {"checkpoint": ckpt, "runtime": runtime}


def export_stage_for(device_type: str) -> str:
    """``loaded`` on CPU (processing packs weights into opaque kernel
    handles there), ``processed`` elsewhere, as vLLM's own cache does
    (:func:`preload.engine_platform.for_device`, the daemon's rule too)."""
    return for_device(device_type)[0]


def transport_for(device_type: str) -> str:
    return for_device(device_type)[1]


def kernel_backend(vllm_config: Any = None) -> str:
    """The attention backend the engine asked for (``--attention-backend``,
    else ``VLLM_ATTENTION_BACKEND``), else the device type: MLA backends
    process weights their own way."""
    from vllm.platforms import current_platform

    attention = getattr(vllm_config, "attention_config", None)
    asked = getattr(attention, "backend", None)
    if asked is not None:
        return str(getattr(asked, "name", asked))
    return os.environ.get("VLLM_ATTENTION_BACKEND") or str(current_platform.device_type)


def _effective_config(hf_config: Any) -> dict[str, Any] | None:
    """The transformers config vLLM built the model from (config.json after
    hf_overrides, hf_config_path, config_format), without what names where it
    came from (``_name_or_path``, ``_commit_hash``...) or the library version
    (keyed apart, as vllm_version)."""
    if not hasattr(hf_config, "to_dict"):
        return None
    return {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}


def _file_digest(path: Any) -> str | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:  # vLLM reads it too and fails the start; the key says so
        return f"unreadable: {exc.strerror or exc}"


def _multimodal(model_config: Any) -> dict[str, Any]:
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return {}
    # vLLM skips building a modality's tower when its limit is 0 (interfaces.py,
    # MultiModalConfig.get_limit_per_prompt); language_model_only makes every limit 0.
    off = ["*"] if getattr(mm, "language_model_only", False) else sorted(
        str(m) for m in (getattr(mm, "limit_per_prompt", None) or {}) if mm.get_limit_per_prompt(m) == 0)
    attn = getattr(mm, "mm_encoder_attn_dtype", None)
    return {
        "mm_encoder_tp_mode": str(getattr(mm, "mm_encoder_tp_mode", "weights")),
        "mm_encoder_only": bool(getattr(mm, "mm_encoder_only", False)),
        "mm_disabled_modalities": json.dumps(off),
        "mm_encoder_attn_dtype": None if attn is None else str(attn),
        "mm_encoder_fp8_scales_digest": _file_digest(getattr(mm, "mm_encoder_fp8_scale_path", None)),
    }


def key_from_vllm(
    vllm_config: Any,
    content_digest: str,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int,
    pp_rank: int,
    dp_size: int,
    dp_rank: int,
    export_stage: str,
    transport: str,
) -> WeightCacheKey:
    """The key of one rank's resident tensors under ``vllm_config``.

    Dense models key DP as (1, 0): vLLM runs their DP ranks as independent
    replicas with identical weights. MoE models shard experts by DP.
    """
    import vllm

    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    is_moe = bool(getattr(model_config, "is_moe", False))
    text_config = getattr(model_config, "hf_text_config", None) or hf_config
    kernel = getattr(vllm_config, "kernel_config", None)
    parallel = vllm_config.parallel_config
    spec = getattr(vllm_config, "speculative_config", None)
    return rank_key(
        content_digest,
        is_moe=is_moe,
        config_digest=config_digest(model_config.model),
        architecture=",".join(getattr(hf_config, "architectures", None) or []),
        dtype=dtype_name(model_config.dtype),
        quantization=model_config.quantization,
        quant_config_digest=_digest(_quant(hf_config, model_config)),
        rope_digest=_digest(_rope(text_config)),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        kv_cache_dtype_skip_layers=json.dumps(
            sorted(set(getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None) or []))),
        # A daemon built from this config holds the target model; a draft
        # model's config would name it as the speculative draft.
        is_draft=bool(spec is not None and getattr(spec, "draft_model_config", None) is model_config),
        expert_placement_strategy=str(getattr(parallel, "expert_placement_strategy", "linear")),
        moe_backend=str(getattr(kernel, "moe_backend", "auto")),
        linear_backend=str(getattr(kernel, "linear_backend", "auto")),
        linear_backend_per_quant=json.dumps(
            sorted([str(k), str(v)] for k, v in (getattr(kernel, "linear_backend_per_quant", None) or {}).items())),
        tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank,
        dp_size=dp_size, dp_rank=dp_rank,
        enable_expert_parallel=bool(vllm_config.parallel_config.enable_expert_parallel),
        kernel_backend=kernel_backend(vllm_config),
        model_impl=str(getattr(model_config, "model_impl", "auto")),
        runner_type=str(getattr(model_config, "runner_type", "generate")),
        convert_type=str(getattr(model_config, "convert_type", "none")),
        hf_config_digest=_digest(_effective_config(hf_config)),
        model_class_overrides=json.dumps(getattr(model_config, "model_class_overrides", None) or {}, sort_keys=True),
        **_multimodal(model_config),
        eplb_redundant_experts=(int(getattr(getattr(parallel, "eplb_config", None), "num_redundant_experts", 0) or 0)
                                if getattr(parallel, "enable_eplb", False) else 0),
        pcp_size=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        dcp_q_replicate=bool(getattr(parallel, "dcp_q_replicate", False)),
        additional_config_digest=_digest(getattr(vllm_config, "additional_config", None) or None),
        engram_embedding_across_dp=bool(getattr(getattr(vllm_config, "engram_config", None),
                                                "embedding_across_dp", False)),
        export_stage=export_stage,
        transport=transport,
        vllm_version=vllm.__version__,
    )


def rank_key(content_digest: str, *, is_moe: bool, dp_size: int = 1, dp_rank: int = 0,
             **fields: Any) -> WeightCacheKey:
    """The one rule for a rank's key, shared by the loader, the daemon
    (through :func:`key_from_vllm`) and the gate's key checks.

    Dense models key DP as (1, 0): vLLM runs their DP ranks as independent
    replicas with identical weights (it resets ``data_parallel_rank`` to 0 in
    each engine core). MoE models shard experts by DP.

    >>> rank_key("ab" * 32, is_moe=False, dp_size=2, dp_rank=1).dp_size
    1
    """
    return WeightCacheKey(content_digest=content_digest, dp_size=dp_size if is_moe else 1,
                          dp_rank=dp_rank if is_moe else 0, **fields)
