"""WeightCacheKey: everything that decides whether resident tensors are ours.

The checkpoint part is the content digest (every byte), not a hash of the
safetensors headers. The rest is every setting that changes the resident
tensors. The key is computed before weight loading on both sides:
``process_weights_after_loading`` may mutate the quantization config.

This module does not import vLLM; ``preload.vllm_key`` builds a key from a
vLLM config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

PROTOCOL_VERSION = 1
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

    def mismatched_fields(self, other: WeightCacheKey) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> WeightCacheKey:
        """Parse a key from the wire; unknown or missing fields are a ValueError."""
        if not isinstance(obj, dict):
            raise ValueError("cache key must be a JSON object")
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(obj) - set(names))
        if unknown:
            raise ValueError(f"unknown cache key fields: {unknown}")
        if "content_digest" not in obj:
            raise ValueError("cache key lacks content_digest")
        for k, v in obj.items():
            default = getattr(cls, k, None) if k != "content_digest" else ""
            expected = type(default) if default is not None else (str, type(None))
            if isinstance(expected, type) and expected in (int, bool, str):
                if expected is int and (not isinstance(v, int) or isinstance(v, bool)):
                    raise ValueError(f"cache key field {k} must be an integer")
                if expected is not int and not isinstance(v, expected):
                    raise ValueError(f"cache key field {k} must be {expected.__name__}")
            elif v is not None and not isinstance(v, str):
                raise ValueError(f"cache key field {k} must be a string or null")
        return cls(**obj)
