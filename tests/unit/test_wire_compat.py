"""Wire compatibility across the msgspec change, against fixed bytes.

Every frame below was produced by ``protocol.encode`` of the release before
the hand-written validators were replaced with msgspec (commit 70fcf10), from
the bodies its daemon and client build. Both directions are held:

- old -> new: the bytes a current daemon or engine sends decode and pass the
  new validators (requests, reply envelopes, cache key, layout, descriptors);
- new -> old: what the new code builds for the same frame is the very same
  bytes, so the old decoder (``json.loads`` and the old field checks, which
  accepted exactly these bytes) accepts it.

A control per direction: a frame one byte off is refused, and a key with one
field of the wrong type does not round-trip.

Protocol version 2 (engines report each attach: ``attached``) changed the
frames above in one byte each, the version in ``hello``, its reply and the
key's ``protocol_version`` (1 -> 2, lengths unchanged), and added the two
``attached`` frames; ``V1_HELLO`` keeps the old hello, which the handshake now
refuses by name.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

from pgbase.errors import ProtocolError, WeightCacheUnavailableError
from preload import protocol
from preload.identity.key import WeightCacheKey
from preload.transports.base import Layout
from preload.transports.cuda import parse_descriptor

pytestmark = pytest.mark.unit

_KEY = (
    b'{"content_digest":"abababababababababababababababababababababababababababababababab",'
    b'"config_digest":null,"architecture":"LlamaForCausalLM","dtype":"bfloat16","quantization":null,'
    b'"quant_config_digest":null,"rope_digest":null,"kv_cache_dtype":"auto","tp_size":2,"tp_rank":1,'
    b'"pp_size":1,"pp_rank":0,"dp_size":1,"dp_rank":0,"enable_expert_parallel":false,'
    b'"expert_placement_strategy":"linear","kv_cache_dtype_skip_layers":"[]","is_draft":false,'
    b'"moe_backend":"auto","linear_backend":"auto","linear_backend_per_quant":"[]",'
    b'"kernel_backend":"auto","export_stage":"loaded","transport":"shm","vllm_version":"0.33.0",'
    b'"protocol_version":2}'
)
_IDENTITY = (
    b'"daemon_id":"d-1","digest":"abababababababababababababababababababababababababababababababab",'
    b'"rank":0,"stage":"loaded","transport":"shm","pid":7,"gpu_uuid":null'
)
_ENTRIES = (
    b'[{"name":"model.embed.weight","dtype":"bfloat16","shape":[4,8],"offset":0,"nbytes":64,"kind":"param"},'
    b'{"name":"rope.cos","dtype":"float32","shape":[3],"offset":256,"nbytes":12,"kind":"buffer"}]'
)
_CUDA_DESCRIPTOR = (
    b'{"kind":"cuda","mode":"arena","size":512,"gpu_uuid":"GPU-1234","device_index":0,"pid":7,'
    b'"handles":[{"handle":"AP8QaXBj","storage_size":512,"storage_offset":0,'
    b'"ref_counter":"L3RvcmNoXzFfMg==","ref_counter_offset":8,"event":"","event_sync_required":false}]}'
)
# name -> the whole frame (header included) as the old code encoded it.
FRAMES: dict[str, bytes] = {
    "hello": b'\x00\x00\x00?{"cmd":"hello","protocol":2,"client":"preload-gate","pid":4242}',
    "hello_reply": b'\x00\x00\x00\xbe{"status":"ok","protocol":2,' + _IDENTITY + b"}",
    "attached_ok": b'\x00\x00\x00\x1c{"cmd":"attached","ok":true}',
    "attached_failed": (b'\x00\x00\x00e{"cmd":"attached","ok":false,"kind":"verify",'
                        b'"detail":"resident checksum mismatch on lm_head.weight"}'),
    "get_state": b'\x00\x00\x02\x8e{"cmd":"get_state","key":' + _KEY + b"}",
    "ok_shm": (
        b'\x00\x00\x04\xf0{"status":"ok",' + _IDENTITY + b',"entries":' + _ENTRIES
        + b',"total_bytes":512,"aliases":{"lm_head.weight":"model.embed.weight"},'
        b'"descriptor":{"kind":"shm","size":512,"seals":["F_SEAL_SEAL","F_SEAL_WRITE"]},"key":' + _KEY
        + b',"checksums":{"model.embed.weight":"0000000000000000000000000000000000000000000000000000000000000000"}}'
    ),
    "cuda_descriptor": b"\x00\x00\x00\xff" + _CUDA_DESCRIPTOR,
    "mismatch": (
        b'\x00\x00\x03\x0b{"status":"mismatch","fields":["dtype","tp_size"],"key":' + _KEY
        + b',"daemon_id":"d-1","digest":"abababababababababababababababababababababababababababababababab"}'
    ),
    "error": b'\x00\x00\x007{"status":"error","error":"get_state: bad key: \\u00e9"}',
    "stats": b'\x00\x00\x00V{"status":"ok","load_seconds":1.25,"misses":{"key_mismatch:dtype":2},"released":false}',
}

V1_HELLO = b'\x00\x00\x00?{"cmd":"hello","protocol":1,"client":"preload-gate","pid":4242}'

KEY = WeightCacheKey(content_digest="ab" * 32, architecture="LlamaForCausalLM", dtype="bfloat16",
                     tp_size=2, tp_rank=1, vllm_version="0.33.0")
LAYOUT = Layout.plan([("model.embed.weight", torch.bfloat16, (4, 8), "param"),
                      ("rope.cos", torch.float32, (3,), "buffer")])
# The old cuda descriptor (a torch IPC handle) as the old daemon built it.
OLD_CUDA = {"kind": "cuda", "mode": "arena", "size": 512, "gpu_uuid": "GPU-1234", "device_index": 0, "pid": 7,
            "handles": [{"handle": "AP8QaXBj", "storage_size": 512, "storage_offset": 0,
                         "ref_counter": "L3RvcmNoXzFfMg==", "ref_counter_offset": 8, "event": "",
                         "event_sync_required": False}]}


def _built(name: str) -> dict:
    """The body the new code builds for frame ``name`` (as daemon and client do)."""
    identity = {"daemon_id": "d-1", "digest": "ab" * 32, "rank": 0, "stage": "loaded",
                "transport": "shm", "pid": 7, "gpu_uuid": None}
    return {
        "hello": lambda: protocol.hello_request("preload-gate", 4242),
        "hello_reply": lambda: {"status": "ok", "protocol": protocol.PROTOCOL_VERSION, **identity},
        "attached_ok": lambda: protocol.attach_report(True),
        "attached_failed": lambda: protocol.attach_report(False, "verify", "resident checksum mismatch on lm_head.weight"),
        "get_state": lambda: {"cmd": "get_state", "key": KEY.to_json()},
        "ok_shm": lambda: {
            "status": "ok", **identity, "entries": LAYOUT.to_json(), "total_bytes": LAYOUT.total_bytes,
            "aliases": {"lm_head.weight": "model.embed.weight"},
            "descriptor": {"kind": "shm", "size": 512, "seals": ["F_SEAL_SEAL", "F_SEAL_WRITE"]},
            "key": KEY.to_json(), "checksums": {"model.embed.weight": "0" * 64},
        },
        "cuda_descriptor": lambda: OLD_CUDA,
        "mismatch": lambda: {"status": "mismatch", "fields": ["dtype", "tp_size"], "key": KEY.to_json(),
                             "daemon_id": "d-1", "digest": "ab" * 32},
        "error": lambda: protocol.error_reply("get_state: bad key: é"),
        "stats": lambda: {"status": "ok", "load_seconds": 1.25, "misses": {"key_mismatch:dtype": 2},
                          "released": False},
    }[name]()


def _received(data: bytes) -> protocol.Frame:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.sendall(data)
        frame = protocol.recv_frame(b, 5.0)
    finally:
        a.close()
        b.close()
    assert frame is not None
    return frame


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_new_code_sends_the_old_bytes(name: str) -> None:
    """new -> old: byte-identical, and the old decoder's parse of it is the body."""
    data = protocol.encode(_built(name))
    assert data == FRAMES[name]
    assert json.loads(data[4:].decode("utf-8")) == _built(name)


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_old_bytes_decode_and_validate(name: str) -> None:
    """old -> new: the fixed bytes come off a socket as the body and pass its validator."""
    body = _received(FRAMES[name]).body
    assert body == _built(name)
    if "cmd" in body:
        assert protocol.check_request(body) == body["cmd"]
    elif name == "cuda_descriptor":
        # The frame still decodes; the IPC-handle arena it names is gone (VMM arenas
        # since issue 26), so attaching is refused by name, not misread.
        with pytest.raises(WeightCacheUnavailableError, match="torch IPC handle"):
            parse_descriptor(body, LAYOUT)
    elif name == "error":
        with pytest.raises(ProtocolError, match="daemon refused get_state: get_state: bad key: é"):
            protocol.check_reply(body, "get_state")
    else:
        assert protocol.check_reply(body, "get_state") is body
    if "key" in body:
        assert WeightCacheKey.from_json(body["key"]) == KEY
    if "entries" in body:
        assert Layout.from_json(body["entries"], body["total_bytes"]) == LAYOUT


def test_control_a_frame_one_byte_short_is_refused() -> None:
    data = FRAMES["hello"]
    with pytest.raises(ProtocolError):
        _received(data[:-1])


def test_control_a_key_with_one_wrong_type_is_refused() -> None:
    obj = json.loads(_KEY)
    obj["tp_size"] = "2"
    with pytest.raises(ValueError, match="tp_size"):
        WeightCacheKey.from_json(obj)


def test_a_field_added_since_travels_only_when_set() -> None:
    """Keys at every new field's default are the old bytes (above); a key that
    sets one sends it, and it comes back whole (an old peer refuses it by name:
    it could not serve that setting)."""
    import dataclasses

    from preload.identity.key import SENT_WHEN_SET

    names = {f.name for f in dataclasses.fields(WeightCacheKey)}
    assert SENT_WHEN_SET <= names and "model_impl" in SENT_WHEN_SET
    assert not SENT_WHEN_SET & set(json.loads(_KEY))  # the fixed bytes predate them all
    impl = dataclasses.replace(KEY, model_impl="transformers")
    assert impl.to_json()["model_impl"] == "transformers" and "model_impl" not in KEY.to_json()
    assert WeightCacheKey.from_json(impl.to_json()) == impl
    assert KEY.mismatched_fields(WeightCacheKey.from_json(impl.to_json())) == ["model_impl"]


def test_a_version_1_hello_is_refused_by_name() -> None:
    """A release-1 engine never reports its attaches: the daemon would count
    each one failed, so the handshake refuses it, naming both versions."""
    body = _received(V1_HELLO).body
    assert protocol.check_request(body) == "hello"  # the shape is still a hello
    with pytest.raises(ProtocolError, match="protocol version 1 is not 2; run the daemon and the engine"):
        protocol.check_version(body["protocol"])
    protocol.check_version(_received(FRAMES["hello"]).body["protocol"])  # control: the current one passes


def test_status_shows_no_field_that_travels_only_when_set_at_its_default() -> None:
    """The key as it comes back (:meth:`WeightCacheKey.to_json`) lacks the
    fields sent only when set; status's key line names none of them, and
    names one that is set (was: ``model_impl=None runner_type=None ...``)."""
    import dataclasses

    from preload.daemon.status import _key_text
    from preload.identity.key import SENT_WHEN_SET

    text = _key_text(KEY.to_json())
    assert not [n for n in SENT_WHEN_SET - {"model_impl"} if f"{n}=" in text], text
    assert "model_impl=auto" in text  # absent on the wire means the default, named as such (not None)
    assert "model_impl=transformers" in _key_text(dataclasses.replace(KEY, model_impl="transformers").to_json())


def test_status_key_line_names_every_engine_setting_the_key_sets() -> None:
    """Text status names what ``--json`` does for the settings an operator
    matches against an engine (dtype, kv-cache dtype, model_impl, the vLLM
    release), at their default too, in the key's field order (was: only the
    layout, config_digest, architecture and fields off their default).
    Control: a raw key, which sets no dtype and no vLLM release, names none."""
    from preload.daemon.status import _key_text

    text = _key_text(KEY.to_json())
    want = ["tp 1/2 pp 0/1 dp 0/1", "architecture=LlamaForCausalLM", "dtype=bfloat16", "kv_cache_dtype=auto",
            "model_impl=auto", "vllm_version=0.33.0"]
    assert [text.index(w) for w in want] == sorted(text.index(w) for w in want), text
    assert "moe_backend=" not in text and "is_draft=" not in text  # off-default only: concise
    raw = _key_text(WeightCacheKey(content_digest="ab" * 32, architecture="X", export_stage="raw").to_json())
    assert "dtype=" not in raw.replace("kv_cache_dtype=", "") and "vllm_version=" not in raw, raw
