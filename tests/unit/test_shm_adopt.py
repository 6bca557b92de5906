"""The shm side of the re-adoption contract (issue 26): deposit, adopt, prove.

A memfd the depositor sealed proves itself: its seals say no byte changed
since it was hashed. Each refusal row has a passing neighbour (the sealed
arena) and a control that builds exactly the fault it names.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest
import torch

from preload.transports.base import AdoptError, Arena, ArenaProofError, Layout, Transport
from preload.transports.shm import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SHRINK,
    SEALS,
    ShmArena,
    ShmTransport,
)

pytestmark = pytest.mark.unit


def _layout() -> Layout:
    return Layout.plan([("w", torch.float32, (8, 4), "param"), ("ids", torch.int64, (3,), "buffer")])


def _filled(seal: bool = True) -> tuple[ShmArena, dict[str, torch.Tensor]]:
    arena = ShmTransport().create(_layout())
    v = arena.views()
    v["w"].copy_(torch.arange(32, dtype=torch.float32).view(8, 4))
    v["ids"].copy_(torch.tensor([7, 8, 9]))
    want = {k: t.clone() for k, t in v.items()}
    del v
    if seal:
        arena.seal()
    return arena, want


def test_deposit_adopt_prove_serves_the_same_bytes():
    arena, want = _filled()
    t = ShmTransport()
    descriptor, fds = arena.deposit()
    arena.close()  # the depositor is gone: only the store's fd keeps the memory
    adopted = t.adopt(descriptor, fds, _layout())
    try:
        assert adopted.adopted and adopted.sealed
        proof = t.prove(adopted, {})
        assert (proof.method, proof.tensors, proof.bytes) == ("seals", 2, _layout().total_bytes)
        with pytest.raises(RuntimeError, match="sealed"):
            adopted.views()
        att = t.attach(adopted.descriptor(), [os.dup(fd) for fd in adopted.fds()], adopted.layout)
        assert all(torch.equal(att.tensors[k], w) for k, w in want.items())
        again, again_fds = adopted.deposit()  # a successor re-deposits what it adopted
        assert again == descriptor
        for fd in again_fds:
            os.close(fd)
    finally:
        adopted.close()


def test_shm_proof_needs_no_checksums():
    assert ShmTransport().proof_needs_checksums is False


def test_deposit_refuses_an_unsealed_arena():
    arena, _ = _filled(seal=False)
    try:
        with pytest.raises(RuntimeError, match="unsealed"):
            arena.deposit()
    finally:
        arena.close()


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, F_ADD_SEALS, seals)
    return fd


def test_proof_fails_without_the_write_seal():
    # Control: the same memfd with every seal but write. Anyone holding it may
    # have changed the bytes after they were hashed.
    t = ShmTransport()
    size = _layout().total_bytes
    adopted = t.adopt({"kind": "shm", "size": size}, [_memfd(size, F_SEAL_SHRINK | F_SEAL_GROW)], _layout())
    try:
        with pytest.raises(ArenaProofError, match=r"lacks seals \['seal', 'write'\]"):
            t.prove(adopted, {})
    finally:
        adopted.close()


def test_proof_fails_on_a_size_other_than_the_layout():
    t = ShmTransport()
    size = _layout().total_bytes
    # Control: fully sealed, but not the size the record describes.
    adopted = t.adopt({"kind": "shm", "size": size}, [_memfd(size + 4096, SEALS)], _layout())
    try:
        with pytest.raises(ArenaProofError, match=f"holds {size + 4096} bytes"):
            t.prove(adopted, {})
    finally:
        adopted.close()


def test_proof_fails_on_a_file_that_is_no_memfd():
    t = ShmTransport()
    size = _layout().total_bytes
    with tempfile.TemporaryFile() as f:
        f.truncate(size)
        adopted = t.adopt({"kind": "shm", "size": size}, [os.dup(f.fileno())], _layout())
        try:
            with pytest.raises(ArenaProofError, match="not a sealable memfd"):
                t.prove(adopted, {})
        finally:
            adopted.close()


@pytest.mark.parametrize(("kind", "size", "nfds", "match"), [
    ("cuda", None, 1, "transport 'cuda', not shm"),
    ("shm", None, 2, "one memfd; the store returned 2"),
    ("shm", 1, 1, "described as 1 bytes"),
])
def test_adopt_refuses_the_wrong_shape_and_closes_the_fds(kind, size, nfds, match):
    descriptor = {"kind": kind, "size": _layout().total_bytes if size is None else size}
    fds = [_memfd(_layout().total_bytes, 0) for _ in range(nfds)]
    with pytest.raises(AdoptError, match=match):
        ShmTransport().adopt(descriptor, fds, _layout())
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed: adopt took ownership


def test_the_default_transport_cannot_adopt():
    class NoAdopt(Transport):
        name = "none"
        engines_can_write = True

        def create(self, layout: Layout) -> Arena:
            raise NotImplementedError

        def attach(self, descriptor, fds, layout):
            raise NotImplementedError

    t = NoAdopt()
    assert t.proof_needs_checksums is True
    fd = _memfd(16, 0)
    with pytest.raises(AdoptError, match="cannot adopt"):
        t.adopt({}, [fd], _layout())
    with pytest.raises(OSError):
        os.fstat(fd)
