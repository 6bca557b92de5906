"""The CUDA transport's wire form: JSON only, checked field by field (no GPU needed)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pgbase.errors import WeightCacheUnavailableError
from preload.transports import get_transport, transport_for
from preload.transports.base import Layout
from preload.transports.cuda import ARENA, PER_TENSOR, CudaTransport, IpcHandle, parse_descriptor

pytestmark = pytest.mark.unit

LAYOUT = Layout.plan([
    ("a", torch.bfloat16, (16, 8), "param"),
    ("b", torch.float32, (3,), "param"),
])


def _handle(size: int = LAYOUT.total_bytes) -> IpcHandle:
    return IpcHandle(
        handle=os.urandom(64) + b"\x00\xff", storage_size=size, storage_offset=512,
        ref_counter=b"/torch_123_456", ref_counter_offset=7, event=os.urandom(64), event_sync_required=True,
    )


def _descriptor(mode: str = ARENA, handles: list[IpcHandle] | None = None) -> dict:
    if handles is None:
        handles = [_handle()] if mode == ARENA else [_handle(e.nbytes) for e in LAYOUT.entries]
    return {
        "kind": "cuda", "mode": mode, "size": LAYOUT.total_bytes, "gpu_uuid": "GPU-1234",
        "device_index": 0, "pid": 1, "handles": [h.to_json() for h in handles],
    }


@pytest.mark.parametrize("mode", [ARENA, PER_TENSOR])
def test_descriptor_survives_json_byte_for_byte(mode: str) -> None:
    desc = _descriptor(mode)
    wire = json.loads(json.dumps(desc))  # what the protocol does to it
    got_mode, uuid, handles = parse_descriptor(wire, LAYOUT)
    assert (got_mode, uuid) == (mode, "GPU-1234")
    assert [h.to_json() for h in handles] == desc["handles"]
    original = _handle()
    assert IpcHandle.from_json(json.loads(json.dumps(original.to_json()))) == original


def _broken(change: str) -> dict:
    desc = _descriptor()
    h = desc["handles"][0]
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
    elif change == "count":
        desc["handles"].append(dict(h))
    elif change == "base64":
        h["handle"] = "not base64!"
    elif change == "bool_as_int":
        h["storage_offset"] = True
    elif change == "negative":
        h["storage_offset"] = -1
    elif change == "unknown_field":
        h["__reduce__"] = "os.system"
    elif change == "small_storage":
        h["storage_size"] = LAYOUT.total_bytes - 1
    elif change == "missing_field":
        del h["event"]
    return desc


@pytest.mark.parametrize(
    "change,message",
    [
        # Shape errors are msgspec's: the message names the path.
        ("kind", "not cuda"), ("mode", r"'pickled' - at `\$.mode`"), ("uuid", "field `gpu_uuid`"),
        ("empty_uuid", r"length >= 1 - at `\$.gpu_uuid`"),
        ("size", "the layout needs"), ("count", "needs 1 handle"),
        ("base64", r"base64 encoded string - at `\$.handles\[0\].handle`"),
        ("bool_as_int", r"got `bool` - at `\$.handles\[0\].storage_offset`"),
        ("negative", r">= 0 - at `\$.handles\[0\].storage_offset`"),
        ("unknown_field", "unknown field `__reduce__`"),
        ("small_storage", "shared storage holds"), ("missing_field", "field `event`"),
    ],
)
def test_malformed_descriptors_are_refused_by_name(change: str, message: str) -> None:
    with pytest.raises(WeightCacheUnavailableError, match=message):
        parse_descriptor(_broken(change), LAYOUT)


def test_control_the_unbroken_descriptor_parses() -> None:
    parse_descriptor(_descriptor(), LAYOUT)


def test_transport_is_selectable_by_name_and_imports_without_cuda() -> None:
    t = get_transport("cuda")
    assert isinstance(t, CudaTransport) and t.name == "cuda"


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
def test_attach_without_cuda_says_so_and_closes_fds() -> None:
    r, w = os.pipe()
    with pytest.raises(WeightCacheUnavailableError, match="no CUDA device"):
        CudaTransport().attach(_descriptor(), [r], LAYOUT)
    with pytest.raises(OSError):
        os.close(r)  # attach closed it
    os.close(w)
