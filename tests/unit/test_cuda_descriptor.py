"""The CUDA transport's wire form: JSON only, checked field by field (no GPU needed)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pgbase.errors import WeightCacheUnavailableError
from preload.transports import get_transport, transport_for
from preload.transports.base import AdoptError, Layout
from preload.transports.cuda import CudaTransport, VmmDescriptor, parse_descriptor

pytestmark = pytest.mark.unit

LAYOUT = Layout.plan([
    ("a", torch.bfloat16, (16, 8), "param"),
    ("b", torch.float32, (3,), "param"),
])
GRAN = 2 << 20


def _descriptor() -> dict:
    return {
        "kind": "cuda", "mode": "vmm", "size": LAYOUT.total_bytes, "alloc_bytes": GRAN, "granularity": GRAN,
        "gpu_uuid": "GPU-1234", "device_index": 0, "pid": 1,
    }


def test_descriptor_survives_json() -> None:
    wire = json.loads(json.dumps(_descriptor()))  # what the protocol does to it
    d = parse_descriptor(wire, LAYOUT)
    assert d == VmmDescriptor("cuda", "vmm", "GPU-1234", LAYOUT.total_bytes, GRAN, GRAN)


def _broken(change: str) -> dict:
    desc = _descriptor()
    if change == "kind":
        desc["kind"] = "shm"
    elif change == "mode":
        desc["mode"] = "pickled"
    elif change == "uuid":
        del desc["gpu_uuid"]
    elif change == "empty_uuid":
        desc["gpu_uuid"] = ""
    elif change == "size":
        desc["size"] = LAYOUT.total_bytes + 256
    elif change == "bool_as_int":
        desc["alloc_bytes"] = True
    elif change == "zero_granularity":
        desc["granularity"] = 0
    elif change == "not_granular":
        desc["alloc_bytes"] = GRAN + 4096
    elif change == "legacy_ipc":
        desc.update(mode="arena", handles=[{"handle": "AP8QaXBj"}])
    return desc


@pytest.mark.parametrize(
    "change,message",
    [
        # Shape errors are msgspec's: the message names the path.
        ("kind", "not cuda"), ("mode", r"'pickled' - at `\$.mode`"), ("uuid", "field `gpu_uuid`"),
        ("empty_uuid", r"length >= 1 - at `\$.gpu_uuid`"), ("size", "the layout needs"),
        ("bool_as_int", r"got `bool` - at `\$.alloc_bytes`"), ("zero_granularity", r">= 1 - at `\$.granularity`"),
        ("not_granular", "in granules of"),
        ("legacy_ipc", "torch IPC handle .* restart the daemon"),
    ],
)
def test_malformed_descriptors_are_refused_by_name(change: str, message: str) -> None:
    with pytest.raises(WeightCacheUnavailableError, match=message):
        parse_descriptor(_broken(change), LAYOUT)
    # adopt asks the same questions and answers with the contract's error type
    with pytest.raises(AdoptError, match=message):
        parse_descriptor(_broken(change), LAYOUT, AdoptError)


def test_an_allocation_smaller_than_the_arena_is_refused() -> None:
    desc = dict(_descriptor(), alloc_bytes=256, granularity=256, size=LAYOUT.total_bytes)
    with pytest.raises(WeightCacheUnavailableError, match="cannot hold"):
        parse_descriptor(desc, LAYOUT)


def test_control_the_unbroken_descriptor_parses() -> None:
    parse_descriptor(_descriptor(), LAYOUT)


def test_transport_is_selectable_by_name_and_imports_without_cuda() -> None:
    t = get_transport("cuda")
    assert isinstance(t, CudaTransport) and t.name == "cuda"
    assert t.proof_needs_checksums is True  # device memory has no seal: the proof recomputes checksums


@pytest.mark.parametrize(("kind", "can_write"), [("cuda", True), ("shm", False)])
def test_a_descriptor_names_its_transport_and_whether_engines_can_write(kind: str, can_write: bool) -> None:
    """Callers above the transports ask the interface, never the kind: a CUDA
    arena has no write seal (engines verify checksums), a sealed memfd does."""
    t = transport_for({"kind": kind, "size": 0})
    assert t.name == kind and t.engines_can_write is can_write
    assert get_transport(kind).engines_can_write is can_write


def test_a_descriptor_of_no_known_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown transport"):
        transport_for({"size": 0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
@pytest.mark.parametrize("nfds", [1, 2])
def test_attach_without_cuda_says_so_and_closes_fds(nfds: int) -> None:
    pipes = [os.pipe() for _ in range(nfds)]
    match = "no CUDA device" if nfds == 1 else "exactly one fd, got 2"
    with pytest.raises(WeightCacheUnavailableError, match=match):
        CudaTransport().attach(_descriptor(), [r for r, _ in pipes], LAYOUT)
    for r, w in pipes:
        with pytest.raises(OSError):
            os.close(r)  # attach closed it
        os.close(w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
@pytest.mark.parametrize("desc,match", [(_descriptor(), "no CUDA device"), ({"kind": "shm"}, "not cuda")])
def test_adopt_refuses_with_the_contracts_error_and_closes_the_fd(desc: dict, match: str) -> None:
    r, w = os.pipe()
    with pytest.raises(AdoptError, match=match):
        CudaTransport().adopt(desc, [r], LAYOUT)
    with pytest.raises(OSError):
        os.close(r)
    os.close(w)
