"""The checksum kernel's shape and host-side caches change speed, never lanes."""

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
from preload.checksum import planner
from preload.transports.base import Layout, view

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
SPECS = [
    ("a", torch.bfloat16, (37, 129), "param"),
    ("b", torch.float32, (5000,), "param"),
    ("c", torch.int8, (7,), "param"),
    ("d", torch.bfloat16, (0,), "param"),
    ("e", torch.bfloat16, (3 * 4096 * 2 + 5,), "param"),
]


def _arena() -> tuple[Layout, torch.Tensor, dict[str, torch.Tensor]]:
    layout = Layout.plan(SPECS)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    return layout, base, {e.name: view(base, e) for e in layout.entries}


def test_every_kernel_shape_equals_the_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import torch
        from preload import checksum as ck
        from preload.checksum import planner
        from preload.transports.base import Layout, view
        specs = %r
        specs = [(n, getattr(torch, d), s, k) for n, d, s, k in specs]
        layout = Layout.plan(specs)
        base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8)
        tensors = {e.name: view(base, e) for e in layout.entries}
        ref = ck.checksum_tensors(tensors, layout, backend="torch")
        for tile in (1024, 2048, 4096):
            for iters in (1, 2, 3):  # several programs per tensor, and a partial last one
                lanes = planner.lanes_triton(base, layout, iters=iters, tile=tile)
                got = dict(zip([e.name for e in layout.entries], planner.hex_rows(lanes)))
                assert got == ref, (tile, iters, got, ref)
        # The kernel starts before the views are checked: a view that is not its
        # entry's bytes must still get its own checksum (the per-tensor path).
        moved = dict(tensors, b=base[256 : 256 + 20000].view(torch.float32))
        want = ck.checksum_tensors(moved, layout, backend="torch")
        assert want["b"] != ref["b"] and ck.checksum_tensors(moved, layout, backend="auto") == want
        tensors["e"].view(torch.int16)[-1] ^= 1  # control: the last tile's last element counts
        lanes = planner.lanes_triton(base, layout, iters=2, tile=1024)
        assert planner.hex_rows(lanes)[4] != ref["e"]
        print("ok")
        """
    ) % [(n, str(d).removeprefix("torch."), s, k) for n, d, s, k in SPECS]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": repo_pythonpath()}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_hex_rows_equals_checksum_hex() -> None:
    rng = np.random.default_rng(1)
    lanes = rng.integers(-(2**31), 2**31, size=(50, 3), dtype=np.int64).astype(np.int32)
    lanes[0] = [-1, 0, -(2**31)]
    want = [ck.Checksum.from_lanes(r).hex() for r in lanes.tolist()]
    assert planner.hex_rows(torch.from_numpy(lanes)) == want
    assert planner.hex_rows(torch.zeros((0, 3), dtype=torch.int32)) == []


def test_plan_is_cached_per_layout_object_and_built_for_a_new_one() -> None:
    layout, _base, _tensors = _arena()
    cpu = torch.device("cpu")
    plan = planner.plan_programs(layout, cpu, 1024, 2)
    assert planner.plan_programs(layout, cpu, 1024, 2) is plan
    again = Layout(tuple(layout.entries), layout.total_bytes)
    fresh = planner.plan_programs(again, cpu, 1024, 2)
    assert fresh is not plan and fresh.programs == plan.programs
    assert torch.equal(fresh.seg_of_prog, plan.seg_of_prog)
    # "e" is 49162 bytes: 4 blocks of 4096 words -> 2 groups of 2, 4 tiles of 1024 words each.
    counts = torch.bincount(plan.seg_of_prog.long(), minlength=len(layout.entries)).tolist()
    assert counts == [1 * 4, 1 * 4, 1 * 4, 0, 2 * 4]
    assert planner.plan_programs(layout, cpu, 4096, 2).programs == 1 + 1 + 1 + 0 + 2


def test_arena_base_rejects_a_moved_or_strided_view_and_accepts_the_arena() -> None:
    layout, base, tensors = _arena()
    assert ck.arena_base(tensors, layout) is not None  # control
    moved = dict(tensors)
    moved["b"] = base[256 : 256 + 20000].view(torch.float32)  # same storage, wrong offset
    assert ck.arena_base(moved, layout) is None
    strided = dict(tensors)
    a = tensors["a"]
    strided["a"] = a.t()  # same address and size, not the entry's byte order
    assert ck.arena_base(strided, layout) is None
    assert ck.checksum_tensors(moved, layout)["b"] != ck.checksum_tensors(tensors, layout)["b"]


def test_kernel_shape_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ck.SHAPE_ENV, "2048,4,8")
    assert ck.KernelShape.from_env() == ck.KernelShape(2048, 4, 8)
    monkeypatch.setenv(ck.SHAPE_ENV, "2048,4")
    with pytest.raises(ck.ChecksumSettingsError, match="TILE,ITERS,WARPS"):
        ck.KernelShape.from_env()
    monkeypatch.setenv(ck.SHAPE_ENV, "3000,4,8")
    with pytest.raises(ck.ChecksumSettingsError, match="tile 3000"):
        ck.KernelShape.from_env()
    monkeypatch.delenv(ck.SHAPE_ENV)
    assert ck.KernelShape.from_env() == ck.KernelShape()
