"""The shm transport: a sealed memfd, mapped copy-on-write by engines."""

from __future__ import annotations

import fcntl
import mmap
import os

import pytest
import torch

from pgbase.errors import WeightCacheUnavailableError
from preload.transports import get_transport
from preload.transports.base import Layout
from preload.transports.shm import F_GET_SEALS, SEALS, ShmTransport

pytestmark = pytest.mark.unit


def _layout() -> Layout:
    return Layout.plan([
        ("w", torch.bfloat16, (16, 8), "param"),
        ("b", torch.float32, (5,), "param"),
        ("ids", torch.int64, (3,), "buffer"),
        ("empty", torch.float32, (0,), "param"),
    ])


@pytest.fixture
def sealed():
    t = ShmTransport()
    arena = t.create(_layout())
    v = arena.views()
    v["w"].copy_(torch.randn(16, 8).to(torch.bfloat16))
    v["b"].copy_(torch.arange(5, dtype=torch.float32))
    v["ids"].copy_(torch.tensor([7, 8, 9]))
    expected = {k: t.clone() for k, t in v.items()}
    del v
    arena.seal()
    yield t, arena, expected
    arena.close()


def test_registry_names_shm():
    assert isinstance(get_transport("shm"), ShmTransport)
    with pytest.raises(ValueError, match="unknown transport"):
        get_transport("carrier-pigeon")


def test_round_trip_values_and_alignment(sealed):
    t, arena, expected = sealed
    att = t.attach(arena.descriptor(), [os.dup(arena.fd)], arena.layout)
    for name, want in expected.items():
        assert att.tensors[name].dtype == want.dtype and torch.equal(att.tensors[name], want)
    assert all(e.offset % 256 == 0 for e in arena.layout.entries)


def test_all_four_seals_present(sealed):
    _t, arena, _ = sealed
    assert fcntl.fcntl(arena.fd, F_GET_SEALS) & SEALS == SEALS
    assert sorted(arena.descriptor()["seals"]) == ["grow", "seal", "shrink", "write"]
    # The seals bite: no writable shared mapping, no resize, even for the daemon.
    with pytest.raises(PermissionError):
        mmap.mmap(arena.fd, arena.layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, 1)
    with pytest.raises(PermissionError):
        os.pwrite(arena.fd, b"x", 0)


def test_engine_write_leaves_daemon_copy_untouched(sealed):
    t, arena, expected = sealed
    first = t.attach(arena.descriptor(), [os.dup(arena.fd)], arena.layout)
    first.tensors["w"].fill_(42.0)
    first.tensors["ids"][0] = -1
    assert float(first.tensors["w"][0, 0]) == 42.0  # the engine sees its own write
    second = t.attach(arena.descriptor(), [os.dup(arena.fd)], arena.layout)
    assert torch.equal(second.tensors["w"], expected["w"])
    assert torch.equal(second.tensors["ids"], expected["ids"])


def test_unsealed_memfd_is_refused():
    """Control for the seal check: the same memfd before sealing is refused."""
    t = ShmTransport()
    arena = t.create(_layout())
    try:
        del_views = arena.views()
        del del_views
        with pytest.raises(RuntimeError, match="unsealed"):
            arena.descriptor()
        desc = {"kind": "shm", "size": arena.layout.total_bytes, "seals": []}
        with pytest.raises(WeightCacheUnavailableError, match="lacks seals"):
            t.attach(desc, [os.dup(arena.fd)], arena.layout)
    finally:
        arena.close()


def test_wrong_size_or_kind_or_fd_count_refused(sealed, tmp_path):
    t, arena, _ = sealed
    bigger = Layout(arena.layout.entries, arena.layout.total_bytes + 256)
    with pytest.raises(WeightCacheUnavailableError, match="bytes"):
        t.attach(arena.descriptor(), [os.dup(arena.fd)], bigger)
    with pytest.raises(WeightCacheUnavailableError, match="not shm"):
        t.attach({**arena.descriptor(), "kind": "cuda"}, [os.dup(arena.fd)], arena.layout)
    with pytest.raises(WeightCacheUnavailableError, match="exactly one fd"):
        t.attach(arena.descriptor(), [], arena.layout)
    plain = tmp_path / "plain"
    plain.write_bytes(b"\0" * arena.layout.total_bytes)
    fd = os.open(plain, os.O_RDONLY)
    with pytest.raises(WeightCacheUnavailableError, match="memfd|seals"):
        t.attach(arena.descriptor(), [fd], arena.layout)


def test_seal_refuses_while_a_view_is_alive():
    t = ShmTransport()
    arena = t.create(_layout())
    keep = arena.views()["w"]
    arena._views = None  # the arena's own dict is gone; an outside reference remains
    try:
        with pytest.raises(RuntimeError, match="still references"):
            arena.seal()
    finally:
        del keep
        arena.close()
