"""The ``preload-gate preload`` flags that set each field of a rank's cache key.

A key mismatch names fields; the act that fixes it is a daemon started with
the engine's values for them. This table says which flag sets which field,
so a miss can print the exact command (``tests/unit/test_loader_misses.py``
parses every flag it can print with the verb's own parser and checks the
value lands where the field comes from).

Every field of the key is in exactly one group (the test holds it, so a new
key field must be placed). Fields no flag sets fall in groups: those that follow from the folder
(its config.json: the daemon reads it when it starts, so a restart on the
folder as it is now fixes them), and engine settings the daemon takes as
vLLM's defaults (kernel backends, expert placement...): an engine that
sets one cannot attach a ``preload`` daemon's weights.
"""

from __future__ import annotations

from collections.abc import Callable

from preload.identity.key import WeightCacheKey


def _value(flag: str, field: str) -> Callable[[WeightCacheKey], str]:
    return lambda k: f"{flag} {getattr(k, field)}"


def _switch(flag: str, field: str) -> Callable[[WeightCacheKey], str]:
    return lambda k: flag if getattr(k, field) else ""


def _quantization(k: WeightCacheKey) -> str:
    return f"--quantization {k.quantization}" if k.quantization else ""


# Key field -> the flag (with the key's value) that sets it; "" where the
# daemon's default is the value (no flag to give).
FLAGS: dict[str, Callable[[WeightCacheKey], str]] = {
    "export_stage": _value("--stage", "export_stage"),
    "transport": _value("--transport", "transport"),
    "dtype": _value("--dtype", "dtype"),
    "quantization": _quantization,
    "kv_cache_dtype": _value("--kv-cache-dtype", "kv_cache_dtype"),
    "tp_size": _value("-tp", "tp_size"),
    "pp_size": _value("-pp", "pp_size"),
    "dp_size": _value("-dp", "dp_size"),
    "enable_expert_parallel": _switch("--enable-expert-parallel", "enable_expert_parallel"),
    "model_impl": _value("--model-impl", "model_impl"),
}
# Fields that follow from others: a rank's place (from the sizes and the socket it answers on).
FOLLOW = frozenset({"tp_rank", "pp_rank", "dp_rank"})
# Fields the daemon reads from the folder when it starts.
FROM_FOLDER = frozenset({"config_digest", "architecture", "quant_config_digest", "rope_digest"})
# Fields of the software on each side.
SOFTWARE = frozenset({"vllm_version", "protocol_version"})
# Engine settings the daemon takes as vLLM's defaults (no flag sets them).
ENGINE_ONLY = frozenset({"expert_placement_strategy", "kv_cache_dtype_skip_layers", "is_draft", "moe_backend",
                         "linear_backend", "linear_backend_per_quant", "kernel_backend", "runner_type",
                         "convert_type", "hf_config_digest", "model_class_overrides", "mm_encoder_tp_mode",
                         "mm_encoder_only", "mm_disabled_modalities", "mm_encoder_attn_dtype",
                         "mm_encoder_fp8_scales_digest", "eplb_redundant_experts", "pcp_size", "dcp_size",
                         "dcp_q_replicate", "additional_config_digest", "engram_embedding_across_dp"})
# The engine arguments behind a key field whose name is not theirs, for a miss line.
SETTING_OF = {
    "runner_type": "--runner", "convert_type": "--convert",
    "hf_config_digest": "--hf-overrides/--hf-config-path/--config-format",
    "model_class_overrides": "--model-class-overrides", "mm_disabled_modalities": "--limit-mm-per-prompt",
    "mm_encoder_fp8_scales_digest": "--mm-encoder-fp8-scale-path", "eplb_redundant_experts": "--enable-eplb",
    "pcp_size": "--prefill-context-parallel-size", "dcp_size": "--decode-context-parallel-size",
    "additional_config_digest": "--additional-config", "kernel_backend": "--attention-backend",
    "engram_embedding_across_dp": "--engram-config",
}
# The content itself: the socket directory is keyed by it.
CONTENT = frozenset({"content_digest"})
# Fields a raw-stage daemon does not key (it runs no vLLM): with the stage
# fixed, they follow.
RAW_UNKEYED = frozenset(f for f in WeightCacheKey.__dataclass_fields__
                        if f not in {"content_digest", "config_digest", "architecture", "export_stage",
                                     "transport", "tp_size", "tp_rank"})


def flags_for(fields: list[str], engine: WeightCacheKey) -> list[str]:
    """The flags, in ``FLAGS`` order, that give a daemon ``engine``'s values for ``fields``."""
    return [f for f in (FLAGS[name](engine) for name in FLAGS if name in fields) if f]


__all__ = ["CONTENT", "ENGINE_ONLY", "FLAGS", "FOLLOW", "FROM_FOLDER", "RAW_UNKEYED", "SETTING_OF", "SOFTWARE",
           "flags_for"]
