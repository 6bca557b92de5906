"""The wire contract: framing, bounds, deadlines, schemas, version, fds."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from pgbase.errors import ProtocolError
from preload import protocol

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_keeps_json_exactly(pair):
    a, b = pair
    body = {"cmd": "stats", "nested": {"x": [1, 2.5, None, True, "é"]}}
    protocol.send_frame(a, body)
    frame = protocol.recv_frame(b, 1.0)
    assert frame is not None and frame.body == body and frame.fds == []


def test_clean_close_between_frames_is_none_mid_frame_is_error(pair):
    a, b = pair
    a.close()
    assert protocol.recv_frame(b, 1.0) is None
    c, d = socket.socketpair()
    c.sendall(struct.pack(">I", 10) + b'{"a"')
    c.close()
    with pytest.raises(ProtocolError, match="mid-frame"):
        protocol.recv_frame(d, 1.0)
    d.close()


def _body_of(n: int) -> dict:
    """A body whose compact JSON payload is exactly ``n`` bytes."""
    return {"x": "y" * (n - len('{"x":""}'))}


def test_oversized_length_is_refused_before_reading(pair):
    """MAX_FRAME_BYTES + 1 in the header is refused from the header alone: no
    payload follows, so a reader that waited for one would hit its deadline."""
    a, b = pair
    a.sendall(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.recv_frame(b, 60.0)


def test_a_frame_of_exactly_the_bound_is_received(pair):
    """Control: a whole frame of exactly MAX_FRAME_BYTES comes through."""
    a, b = pair
    data = protocol.encode(_body_of(protocol.MAX_FRAME_BYTES))
    assert len(data) == 4 + protocol.MAX_FRAME_BYTES
    sender = threading.Thread(target=a.sendall, args=(data,), daemon=True)
    sender.start()
    frame = protocol.recv_frame(b, 120.0)
    sender.join(120)
    assert frame is not None and len(frame.body["x"]) == protocol.MAX_FRAME_BYTES - len('{"x":""}')


def test_sender_refuses_one_byte_over_the_bound(pair):
    a, _b = pair
    with pytest.raises(ProtocolError, match=f"{protocol.MAX_FRAME_BYTES + 1} bytes exceeds"):
        protocol.send_frame(a, _body_of(protocol.MAX_FRAME_BYTES + 1))
    # Control: exactly the bound encodes (sending it is the test above).
    assert len(protocol.encode(_body_of(protocol.MAX_FRAME_BYTES))) == 4 + protocol.MAX_FRAME_BYTES


@pytest.mark.parametrize("payload, match", [
    (b"\xff\xfe", "UTF-8 JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"{nope", "UTF-8 JSON"),
])
def test_garbage_payload_is_a_protocol_error(pair, payload, match):
    a, b = pair
    a.sendall(struct.pack(">I", len(payload)) + payload)
    with pytest.raises(ProtocolError, match=match):
        protocol.recv_frame(b, 1.0)


def test_trickling_peer_hits_the_whole_message_deadline(pair):
    """One byte every 0.1 s keeps each recv busy; the per-message deadline still fires."""
    a, b = pair
    frame = protocol.encode({"cmd": "stats", "pad": "x" * 40})
    whole_frame_sent = threading.Event()

    def trickle():
        for i in range(len(frame)):
            try:
                a.send(frame[i : i + 1])
            except OSError:
                return
            time.sleep(0.1)
        whole_frame_sent.set()

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    with pytest.raises(ProtocolError, match="deadline"):
        protocol.recv_frame(b, deadline_s=0.5)
    # The deadline, not the end of the frame, ended the read (the trickle
    # needs len(frame) x 0.1 s, about 7 s).
    assert not whole_frame_sent.is_set()
    a.close()
    t.join(10)


def test_idle_bound_applies_only_before_the_first_byte(pair):
    a, b = pair
    with pytest.raises(ProtocolError, match="deadline"):
        protocol.recv_frame(b, deadline_s=5.0, idle_s=0.2)
    protocol.send_frame(a, {"ok": 1})  # control: the same reader gets a prompt frame
    assert protocol.recv_frame(b, 1.0, idle_s=0.2).body == {"ok": 1}


def test_fds_travel_with_the_frame(pair, tmp_path):
    a, b = pair
    path = tmp_path / "f"
    path.write_bytes(b"memfd stand-in")
    fd = os.open(path, os.O_RDONLY)
    try:
        protocol.send_frame(a, {"status": "ok"}, [fd])
    finally:
        os.close(fd)
    frame = protocol.recv_frame(b, 1.0)
    assert len(frame.fds) == 1
    try:
        assert os.pread(frame.fds[0], 100, 0) == b"memfd stand-in"
    finally:
        os.close(frame.fds[0])


@pytest.mark.parametrize("body, match", [
    ({}, "lacks a string 'cmd'"),
    ({"cmd": 3}, "lacks a string 'cmd'"),
    ({"cmd": "format_disk"}, "unknown command"),
    # Field checks are msgspec's: its message names the path, after the command.
    ({"cmd": "hello", "client": "x"}, "hello: Object missing required field `protocol`"),
    ({"cmd": "hello", "protocol": "1", "client": "x"}, r"Expected `int`, got `str` - at `\$.protocol`"),
    ({"cmd": "hello", "protocol": True, "client": "x"}, "got `bool`"),
    ({"cmd": "hello", "protocol": 1.0, "client": "x"}, "got `float`"),
    ({"cmd": "hello", "protocol": 1, "client": "x", "pid": "12"}, r"at `\$.pid`"),
    # An optional field may be absent, never null.
    ({"cmd": "hello", "protocol": 1, "client": "x", "pid": None}, r"got `null` - at `\$.pid`"),
    ({"cmd": "get_state", "key": "content"}, r"get_state: Expected `object`, got `str` - at `\$.key`"),
    ({"cmd": "stats", "extra": 1}, "stats: Object contains unknown field `extra`"),
])
def test_schema_rejects_by_name(body, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.check_request(body)


@pytest.mark.parametrize("body", [
    {"cmd": "hello", "protocol": 1, "client": "x"},
    {"cmd": "hello", "protocol": 1, "client": "x", "pid": 7},
    {"cmd": "get_state", "key": {"content_digest": "a" * 64}},
    {"cmd": "get_state", "key": {"content_digest": "a" * 64}, "client": "x"},
    {"cmd": "get_memory"}, {"cmd": "watch"}, {"cmd": "release"}, {"cmd": "stats"},
])
def test_schema_accepts_every_command(body):
    assert protocol.check_request(body) == body["cmd"]


def test_version_handshake():
    protocol.check_version(protocol.PROTOCOL_VERSION)
    for bad in (protocol.PROTOCOL_VERSION + 1, "1", True, None):
        with pytest.raises(ProtocolError, match="protocol version"):
            protocol.check_version(bad)


def test_reply_envelope():
    assert protocol.check_reply({"status": "ok"}, "stats")["status"] == "ok"
    with pytest.raises(ProtocolError, match="daemon refused stats: nope"):
        protocol.check_reply({"status": "error", "error": "nope"}, "stats")
    with pytest.raises(ProtocolError, match="no valid status"):
        protocol.check_reply({"x": 1}, "stats")
    with pytest.raises(ProtocolError, match="list of field names"):
        protocol.check_reply({"status": "mismatch", "fields": "dtype"}, "get_state")


def test_nothing_is_pickled():
    src = open(protocol.__file__).read()
    assert "pickle" not in src.replace("unpickled", "").replace("no pickle", "").replace("Nothing on this wire is ever", "")
    with pytest.raises(ProtocolError, match="JSON-serialisable"):
        protocol.encode({"x": object()})
