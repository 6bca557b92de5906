"""WeightCacheKey covers every field of vLLM 0.33's key that changes what a rank holds.

``data/vllm033_weight_cache_key_fields.json`` is the field list of
``WeightCacheKey`` in the ``vllm==0.33.0`` wheel's ``weight_cache/protocol.py``
(extracted by ``vllm_key_fields.py``; re-extracted and compared below when
the wheel is on this machine). ``COVERED_BY`` maps each of vLLM's fields to
the field of ours that carries it; a vLLM field without a row, or mapped to
a field we lack, fails the test.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import pytest
from vllm_key_fields import from_wheel

from preload.identity.key import WeightCacheKey

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "vllm033_weight_cache_key_fields.json"

# vLLM 0.33 field -> our field, and why it is that one.
COVERED_BY = {
    "checkpoint": ("content_digest", "vLLM hashes safetensors headers; we hash every byte"),
    "revision": ("content_digest", "a revision is other bytes, which the content digest sees"),
    "model_arch": ("architecture", ""),
    "tp_size": ("tp_size", ""),
    "tp_rank": ("tp_rank", ""),
    "dtype": ("dtype", ""),
    "quantization": ("quantization", ""),
    "quant_config_hash": ("quant_config_digest", "checkpoint and runtime quantization config, as vLLM"),
    "rope_parameters_hash": ("rope_digest", "rope parameters and max_position_embeddings"),
    "kv_cache_dtype": ("kv_cache_dtype", ""),
    "kv_cache_dtype_skip_layers": ("kv_cache_dtype_skip_layers", ""),
    "vllm_version": ("vllm_version", ""),
    "pp_size": ("pp_size", ""),
    "pp_rank": ("pp_rank", ""),
    "is_draft": ("is_draft", ""),
    "dp_size": ("dp_size", "MoE only: dense DP replicas hold identical weights"),
    "dp_rank": ("dp_rank", "MoE only, as dp_size"),
    "enable_expert_parallel": ("enable_expert_parallel", ""),
    "expert_placement_strategy": ("expert_placement_strategy", ""),
    "moe_backend": ("moe_backend", ""),
    "linear_backend": ("linear_backend", ""),
    "linear_backend_per_quant": ("linear_backend_per_quant", ""),
}


def uncovered(vllm_fields: list[str], covered_by: dict[str, tuple[str, str]] = COVERED_BY) -> list[str]:
    ours = {f.name for f in fields(WeightCacheKey)}
    return [f for f in vllm_fields if f not in covered_by or covered_by[f][0] not in ours]


def test_every_vllm_033_key_field_is_covered():
    vllm_fields = json.loads(DATA.read_text())["fields"]
    assert len(vllm_fields) >= 20
    assert uncovered(vllm_fields) == []
    # No stale rows either: every row names a field vLLM 0.33 has.
    assert set(COVERED_BY) == set(vllm_fields)


def test_control_a_field_we_lack_is_named():
    vllm_fields = json.loads(DATA.read_text())["fields"]
    assert uncovered([*vllm_fields, "weight_layout_version"]) == ["weight_layout_version"]
    # A table without a row for one of vLLM's fields (a copy: the module's
    # table stays as the other tests read it, whatever the order).
    short = {k: v for k, v in COVERED_BY.items() if k != "moe_backend"}
    assert uncovered(vllm_fields, short) == ["moe_backend"]


def _wheel() -> Path | None:
    env = os.environ.get("VLLM033_WHEEL")
    if env:
        return Path(env)
    return next(iter(sorted(Path("/tmp/vllm033").glob("vllm-0.33.0*.whl"))), None)


def test_checked_in_list_is_what_the_wheel_says():
    """Re-extract from the wheel when it is here (pip download --no-deps vllm==0.33.0 -d /tmp/vllm033)."""
    wheel = _wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip("vllm 0.33.0 wheel not on this machine (set VLLM033_WHEEL)")
    assert from_wheel(wheel) == json.loads(DATA.read_text())["fields"]


def test_a_mismatch_names_the_new_fields():
    a = WeightCacheKey(content_digest="a" * 64)
    b = WeightCacheKey(content_digest="a" * 64, moe_backend="triton", is_draft=True,
                       kv_cache_dtype_skip_layers='["model.layers.0"]')
    assert a.mismatched_fields(b) == ["kv_cache_dtype_skip_layers", "is_draft", "moe_backend"]
    assert WeightCacheKey.from_json(b.to_json()) == b
