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
# an engine's first attach, for this key's 20 fields).
from dataclasses import asdict, dataclass, fields
from typing import Any

from pgbase.json_shape import convert

# 2: engines report each attach (preload.protocol.Attached); see preload.protocol.
PROTOCOL_VERSION = 2
EXPORT_STAGES = ("raw", "loaded", "processed")


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
    export_stage: str = "loaded"
    transport: str = "shm"
    vllm_version: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def mismatched_fields(self, other: "WeightCacheKey") -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> "WeightCacheKey":
        """Parse a key from the wire; an unknown, missing or mistyped field is
        a ValueError naming it (:func:`pgbase.json_shape.convert`)."""
        return convert(obj, cls, "cache key")
