"""WeightCacheKey: everything that decides whether resident tensors are ours.

The checkpoint part is the content digest (every byte), not a hash of the
safetensors headers. The rest is every setting that changes the resident
tensors. The key is computed before weight loading on both sides:
``process_weights_after_loading`` may mutate the quantization config.

This module does not import vLLM; ``preload.vllm_key`` builds a key from a
vLLM config.
"""

# No ``from __future__ import annotations`` here: msgspec reads real
# annotations as they are, and string ones it must eval first (0.35 ms of
# an engine's first attach, for this key's fields).
from dataclasses import asdict, dataclass, fields
from typing import Any

from pgbase.json_shape import convert

# 2: engines report each attach (preload.protocol.Attached); see preload.protocol.
PROTOCOL_VERSION = 2
EXPORT_STAGES = ("raw", "loaded", "processed")


# Fields added after the wire format was fixed (tests/unit/test_wire_compat.py
# holds the bytes): absent on the wire means the default.
SENT_WHEN_SET = frozenset({
    "model_impl", "runner_type", "convert_type", "hf_config_digest", "model_class_overrides", "mm_encoder_tp_mode",
    "mm_encoder_only", "mm_disabled_modalities", "mm_encoder_attn_dtype", "mm_encoder_fp8_scales_digest",
    "eplb_redundant_experts", "pcp_size", "dcp_size", "dcp_q_replicate", "additional_config_digest",
    "engram_embedding_across_dp",
})


@dataclass(frozen=True)
class WeightCacheKey:
    """Fingerprint of one rank's resident weights.

    >>> a = WeightCacheKey(content_digest="a" * 64, tp_size=1)
    >>> b = WeightCacheKey(content_digest="b" * 64, tp_size=2)
    >>> a.mismatched_fields(b)
    ['content_digest', 'tp_size']
    """

    content_digest: str
    config_digest: str | None = None
    architecture: str = ""
    dtype: str = ""
    quantization: str | None = None
    quant_config_digest: str | None = None
    rope_digest: str | None = None
    kv_cache_dtype: str = "auto"
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    # Only MoE models shard by DP; dense models key as (1, 0) like vLLM does.
    dp_size: int = 1
    dp_rank: int = 0
    enable_expert_parallel: bool = False
    # vLLM 0.33's key fields that change what a rank holds (see
    # tests/unit/test_identity_key_fields.py for the field-by-field table).
    expert_placement_strategy: str = "linear"
    kv_cache_dtype_skip_layers: str = "[]"  # JSON of the sorted layer names
    is_draft: bool = False
    moe_backend: str = "auto"
    linear_backend: str = "auto"
    linear_backend_per_quant: str = "[]"  # JSON of sorted [quant, backend] pairs
    kernel_backend: str = "auto"
    # Settings of vLLM's EngineArgs that change which modules are built or
    # what they hold, beyond vLLM 0.33's own key (tests/unit/
    # test_identity_key_fields.py decides every EngineArgs field, with why).
    model_impl: str = "auto"  # vllm / transformers / terratorch classes hold other tensors
    runner_type: str = "generate"
    convert_type: str = "none"  # pooling adapters add or drop heads
    hf_config_digest: str | None = None  # the effective config: hf_overrides, hf_config_path, config_format
    model_class_overrides: str = "{}"  # JSON of the architecture -> class map
    mm_encoder_tp_mode: str = "weights"  # "data": every rank holds the whole encoder
    mm_encoder_only: bool = False
    mm_disabled_modalities: str = "[]"  # JSON of the modalities limited to 0: their towers are not built
    mm_encoder_attn_dtype: str | None = None
    mm_encoder_fp8_scales_digest: str | None = None  # the bytes of mm_encoder_fp8_scale_path
    eplb_redundant_experts: int = 0  # physical experts beyond the logical ones
    pcp_size: int = 1
    dcp_size: int = 1
    dcp_q_replicate: bool = False  # the MLA query projection replicated at load time
    additional_config_digest: str | None = None  # platform plugins read it (gdn_prefill_backend...)
    engram_embedding_across_dp: bool = False  # Engram tables sharded over TP x DP, not per DP replica
    export_stage: str = "loaded"
    transport: str = "shm"
    vllm_version: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def mismatched_fields(self, other: "WeightCacheKey") -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_json(self) -> dict[str, Any]:
        """The key as sent; a field of :data:`SENT_WHEN_SET` only where it is not
        at its default, so a peer of the release before reads the key as it did
        (it refuses a field it does not know: then it cannot serve that setting)."""
        out = asdict(self)
        for f in fields(self):
            if f.name in SENT_WHEN_SET and out[f.name] == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "WeightCacheKey":
        """Parse a key from the wire; an unknown, missing or mistyped field is
        a ValueError naming it (:func:`pgbase.json_shape.convert`)."""
        return convert(obj, cls, "cache key")
