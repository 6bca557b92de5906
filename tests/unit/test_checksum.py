"""Resident-weight checksums: what they catch, with controls for why each lane exists."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from daemon_support import repo_pythonpath

from preload import checksum as ck
from preload.checksum import (
    ResidentWeightsChangedError,
    arena_base,
    checksum_tensors,
    scheme,
    tensor_checksum,
    verify_resident,
)
from preload.transports.base import Layout, view

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _bigint_reference(t: torch.Tensor) -> str:
    """The definition in the module docstring, in plain Python integers."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data += b"\0" * (-len(data) % 4)
    words = np.frombuffer(data, dtype="<u4")
    a = b = c = 0
    for k in np.flatnonzero(words).tolist():  # zero words add nothing
        x = int(words[k])
        blk = k >> 12
        a += x * int(scheme.TA[k % 4096])
        b += x * ((((int(scheme.TB[blk % 4096]) + (blk >> 12) * scheme.KB)) & 0xFFFFFFFF) | 1)
        c += (((x << 16) | (x >> 16)) & 0xFFFFFFFF) * int(scheme.TA[k % 4096])
    m = 0xFFFFFFFF
    return f"{a & m:08x}{b & m:08x}{c & m:08x}"


def _plain_sum(t: torch.Tensor) -> int:
    words = t.contiguous().reshape(-1).view(torch.uint8)
    pad = -words.numel() % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    return int((words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).sum()) & 0xFFFFFFFF


@pytest.mark.parametrize(
    "dtype,numel",
    [(torch.bfloat16, 4099), (torch.float32, 257), (torch.int8, 7), (torch.bfloat16, 0), (torch.float16, 8192 + 3)],
)
def test_torch_path_equals_the_written_definition(dtype: torch.dtype, numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    t = torch.randint(-100, 100, (numel,), generator=g).to(dtype)
    assert tensor_checksum(t) == _bigint_reference(t)


def test_large_block_index_uses_the_high_bits_lane() -> None:
    # Words past 4096 * 4096 exercise B's (b >> 12) term; check it against the definition.
    t = torch.zeros(4096 * 4096 + 8, dtype=torch.int32)
    t[-3] = 12345
    assert tensor_checksum(t) == _bigint_reference(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_changed_element_is_always_caught(dtype: torch.dtype, where: str) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3001, generator=g).to(dtype)  # odd length: the last word is partial for 1- and 2-byte types
    before = tensor_checksum(t)
    i = {"first": 0, "middle": 1500, "last": 3000}[where]
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    raw[i] ^= 1  # flip the lowest bit of one element
    assert tensor_checksum(t) != before


def test_every_single_bit_flip_in_a_word_is_caught() -> None:
    t = torch.zeros(64, dtype=torch.int32)
    before = tensor_checksum(t)
    for bit in range(32):
        u = t.clone()
        u[17] = (1 << bit) if bit < 31 else -(1 << 31)
        assert tensor_checksum(u) != before, bit


def test_swap_is_caught_and_a_plain_sum_would_miss_it() -> None:
    g = torch.Generator().manual_seed(2)
    t = torch.randn(4096, generator=g).to(torch.bfloat16)
    u = t.clone()
    u[[10, 2000]] = u[[2000, 10]]
    assert not torch.equal(t, u)
    assert _plain_sum(t) == _plain_sum(u), "control: an unweighted sum cannot see a swap"
    assert tensor_checksum(t) != tensor_checksum(u)


def test_swap_4096_words_apart_is_caught_by_lane_b_where_lane_a_is_blind() -> None:
    t = torch.zeros(3 * 4096, dtype=torch.int32)
    t[5], t[5 + 4096] = 111, 222
    u = t.clone()
    u[[5, 5 + 4096]] = u[[5 + 4096, 5]]
    a_t, b_t, c_t = (tensor_checksum(t)[i : i + 8] for i in (0, 8, 16))
    a_u, b_u, c_u = (tensor_checksum(u)[i : i + 8] for i in (0, 8, 16))
    assert a_t == a_u and c_t == c_u, "control: the 4096-periodic lanes cannot see this swap"
    assert b_t != b_u


def test_change_in_the_high_half_of_a_word_is_caught_by_lane_c() -> None:
    # Two bf16 elements share a word; this swap changes only the high halves
    # by +d and -d where d is a multiple of 2**16 (so d * w can vanish mod 2**32 in A).
    t = torch.zeros(8192, dtype=torch.int32)
    t[1], t[2] = 3 << 16, 5 << 16
    u = t.clone()
    u[[1, 2]] = u[[2, 1]]
    assert tensor_checksum(t)[16:] != tensor_checksum(u)[16:]


def test_checksum_does_not_depend_on_where_the_arena_put_the_tensor() -> None:
    t = torch.randn(1000).to(torch.bfloat16)
    for pad in (0, 256, 4096 * 4):
        base = torch.zeros(pad + 4096, dtype=torch.uint8)
        place = base[pad : pad + t.numel() * 2].view(torch.bfloat16)
        place.copy_(t)
        assert tensor_checksum(place) == tensor_checksum(t)


def _arena(specs: list[tuple[str, torch.dtype, tuple[int, ...], str]]) -> tuple[Layout, torch.Tensor, dict[str, torch.Tensor]]:
    layout = Layout.plan(specs)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    return layout, base, {e.name: view(base, e) for e in layout.entries}


SPECS = [
    ("embed", torch.bfloat16, (64, 33), "param"),
    ("norm", torch.float32, (129,), "param"),
    ("empty", torch.bfloat16, (0,), "param"),
    ("odd", torch.int8, (5,), "param"),
]


def test_verify_resident_passes_untouched_and_names_the_written_tensor() -> None:
    layout, _base, tensors = _arena(SPECS)
    sums = checksum_tensors(tensors, layout)
    report = verify_resident(tensors, layout, sums)
    assert report.tensors == len(SPECS)
    tensors["norm"][7] += 1.0  # an "engine" writes into a resident weight
    with pytest.raises(ResidentWeightsChangedError) as err:
        verify_resident(tensors, layout, sums)
    assert err.value.changed == ["norm"]
    assert "norm" in str(err.value) and "restart the daemon" in str(err.value)


def test_verify_resident_refuses_entries_without_a_checksum() -> None:
    layout, _base, tensors = _arena(SPECS)
    sums = checksum_tensors(tensors, layout)
    del sums["odd"]
    with pytest.raises(ResidentWeightsChangedError, match="odd .no checksum"):
        verify_resident(tensors, layout, sums)


def test_arena_base_finds_the_arena_and_rejects_unrelated_tensors() -> None:
    layout, base, tensors = _arena(SPECS)
    found = arena_base(tensors, layout)
    assert found is not None and found.data_ptr() == base.data_ptr() and found.numel() == layout.total_bytes
    loose = {n: t.clone() for n, t in tensors.items()}
    assert arena_base(loose, layout) is None
    # Loose tensors still get the same checksums through the per-tensor path.
    assert checksum_tensors(loose, layout) == checksum_tensors(tensors, layout)


def test_resident_checksums_only_for_arenas_engines_can_write() -> None:
    layout, _base, tensors = _arena(SPECS)

    class Sealed:
        engines_can_write = False

    class Writable:
        engines_can_write = True

    sealed, writable = Sealed(), Writable()
    sealed.layout = writable.layout = layout  # type: ignore[attr-defined]
    assert ck.resident_checksums(sealed, tensors) == {}
    assert ck.resident_checksums(writable, tensors) == checksum_tensors(tensors, layout)


def test_triton_kernel_matches_the_reference_in_the_interpreter() -> None:
    """The one-launch kernel, run by Triton's CPU interpreter, equals the torch path
    (the same comparison runs on the real GPU in tests/gpu)."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import torch
        from preload import checksum as ck
        from preload.checksum import planner
        from preload.transports.base import Layout, view
        specs = [("a", torch.bfloat16, (37, 129), "param"), ("b", torch.float32, (5000,), "param"),
                 ("c", torch.int8, (7,), "param"), ("d", torch.bfloat16, (0,), "param"),
                 ("e", torch.bfloat16, (2 * 4096 * 2 + 5,), "param")]
        layout = Layout.plan(specs)
        base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8)
        tensors = {e.name: view(base, e) for e in layout.entries}
        fast = ck.checksum_tensors(tensors, layout, backend="triton")
        ref = ck.checksum_tensors(tensors, layout, backend="torch")
        assert fast == ref, (fast, ref)
        for iters in (1, 2):  # several programs per tensor, and a partial last program
            rows = planner.lanes_triton(base, layout, iters=iters).tolist()
            got = {e.name: ck.Checksum.from_lanes(r).hex() for e, r in zip(layout.entries, rows)}
            assert got == ref, (iters, got, ref)
        tensors["e"].view(torch.int16)[-1] ^= 1
        assert ck.checksum_tensors(tensors, layout, backend="triton")["e"] != fast["e"]
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": repo_pythonpath()}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_triton_backend_refuses_when_unusable() -> None:
    layout, _base, tensors = _arena(SPECS)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this machine can run the kernel")
    with pytest.raises(RuntimeError, match="triton checksum needs CUDA"):
        checksum_tensors(tensors, layout, backend="triton")


def test_arena_checksums_equal_the_per_tensor_ones_and_name_what_changed() -> None:
    """The re-adoption proof's path (an adopted arena's own base, no views to
    check) gives the same checksums; a written tensor and an unrecorded one
    are named (control: the untouched arena names nothing)."""
    layout, base, tensors = _arena(SPECS)
    recorded = ck.checksum_tensors(tensors, layout, backend="torch")
    assert ck.arena_checksums(base, layout) == recorded
    assert ck.changed_tensors(ck.arena_checksums(base, layout), layout, recorded) == []
    first = layout.entries[0]
    base[first.offset] ^= 1
    partial = {k: v for k, v in recorded.items() if k != layout.entries[1].name}
    assert ck.changed_tensors(ck.arena_checksums(base, layout), layout, partial) == [
        first.name, f"{layout.entries[1].name} (no checksum from the daemon)"]
