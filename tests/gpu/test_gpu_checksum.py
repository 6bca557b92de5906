"""The one-launch Triton checksum on the GPU equals the torch reference and
catches a single changed element; the CPU tier checks the same kernel in
Triton's interpreter."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_triton_kernel_equals_the_reference_on_the_gpu() -> None:
    import torch

    from preload.checksum import checksum_tensors
    from preload.transports.base import Layout, view

    specs = [
        ("big", torch.bfloat16, ((80 << 20) // 2 + 3,), "param"),  # > 64 MiB: B's high-bits term
        ("f32", torch.float32, (4097, 3), "param"),
        ("i8", torch.int8, (13,), "param"),
        ("empty", torch.bfloat16, (0,), "param"),
        ("bf16", torch.bfloat16, (1, 4095), "param"),
    ]
    layout = Layout.plan(specs)
    base = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, device="cuda")
    tensors = {e.name: view(base, e) for e in layout.entries}
    fast = checksum_tensors(tensors, layout, backend="triton")
    ref = checksum_tensors(tensors, layout, backend="torch")
    cpu = checksum_tensors({n: t.cpu() for n, t in tensors.items()}, layout, backend="torch")
    assert fast == ref == cpu
    for name in ("big", "i8", "bf16"):
        before = fast[name]
        flat = tensors[name].reshape(-1).view(torch.uint8)
        flat[-1] ^= 0x01
        assert checksum_tensors(tensors, layout, backend="triton")[name] != before, name
        flat[-1] ^= 0x01
        assert checksum_tensors(tensors, layout, backend="triton")[name] == before, name
