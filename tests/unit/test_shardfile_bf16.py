"""BF16 encoding: round to nearest even, byte for byte what the uint64 formula writes."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.shardfile import decode, encode

pytestmark = pytest.mark.unit


def _reference(values: np.ndarray) -> bytes:
    u = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def test_bf16_encoding_matches_the_wide_formula_on_every_kind_of_bit_pattern():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFF7FFF,
                      0xFFFF8000, 0xFFFFFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF], dtype=np.uint32)
    values = np.concatenate([bits, edges]).view(np.float32)
    assert encode(values, "BF16").data == _reference(values)
    # Control: ties go to even (0x3F80_8000 -> 0x3F80, 0x3F81_8000 -> 0x3F82), not up.
    ties = np.array([0x3F808000, 0x3F818000], dtype=np.uint32).view(np.float32)
    assert np.frombuffer(encode(ties, "BF16").data, "<u2").tolist() == [0x3F80, 0x3F82]


def test_bf16_round_trip_keeps_bf16_values():
    v = np.array([1.0, -2.5, 0.0078125, 2.0**127], dtype=np.float32)  # each exact in bf16
    assert decode(encode(v, "BF16").data, "BF16", (4,)).tolist() == v.tolist()
