"""Protocol fuzzing against a live raw-stage daemon.

Ten thousand generated malformed frames (random bytes, oversized and
"negative" lengths, truncated frames, non-UTF-8 and non-JSON payloads,
wrong JSON types, unknown commands and fields, huge strings, deep nesting,
stray descriptors) go to one daemon. The contract: each bad frame gets an
error answer or its connection closed; the daemon never crashes, leaks no
descriptors or threads, and afterwards serves a valid client the right
tensors (checked by digest against the checkpoint's own bytes).

Generation is plain seeded ``random`` (no new dependency): a failure prints
the seed and the case kind, and the same seed replays it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_support import (
    RawDaemon,
    checkpoint_tensor_digests,
    fresh_checkpoint,
    open_fds,
    promoted_daemon,
    served_tensor_digests,
    thread_count,
)

from preload.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="reliability_fuzz")]

SEED = int(os.environ.get("PRELOAD_GATE_FUZZ_SEED", "20261129"))
N_FRAMES = int(os.environ.get("PRELOAD_GATE_FUZZ_FRAMES", "10000"))
MAX_HUGE = 4 << 20  # huge strings: 4 MiB, well under the frame bound


@dataclass(frozen=True)
class Case:
    """One generated input. ``breaks_stream``: nothing after it on this
    connection can be a frame boundary, so it goes last and the connection
    is then half-closed."""

    kind: str
    data: bytes
    breaks_stream: bool = False
    valid: bool = False  # a well-formed request the daemon must answer "ok"


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _json(obj: object) -> bytes:
    return _frame(json.dumps(obj).encode())


_JUNK_VALUES: tuple[object, ...] = (
    None, True, False, 0, -1, 2**63, 2**70, 1.5, -0.0, "", "x", [], {}, [1, 2], {"a": 1},
    "\u0000", "\ud7ff", "../../etc/passwd", 1e308,
)
_COMMANDS = ("hello", "get_state", "get_memory", "watch", "release", "stats", "attached")
# Attach reports on connections where nothing was served (a report of
# nothing, or a malformed one): each is refused by a close, never an answer.
_BAD_REPORTS: tuple[dict[str, object], ...] = (
    {"ok": True}, {"ok": False, "kind": "attach"}, {"ok": "yes"}, {"ok": False, "kind": "bogus"},
    {"ok": True, "kind": "attach"}, {"ok": False}, {"ok": False, "kind": "verify", "detail": 7},
)


def _junk(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 3 or r < 0.6:
        return rng.choice(_JUNK_VALUES)
    if r < 0.8:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(("cmd", "key", "protocol", "client", "pid", "zz")): _junk(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def _bad_key(rng: random.Random) -> object:
    key: dict[str, object] = {"content_digest": "a" * 64, "tp_size": 1}
    choice = rng.randrange(6)
    if choice == 0:
        key["content_digest"] = rng.choice((None, 5, [], "z" * rng.randrange(200)))
    elif choice == 1:
        key["tp_size"] = rng.choice(("1", True, None, 1.0, [1]))
    elif choice == 2:
        key["not_a_field"] = 1
    elif choice == 3:
        del key["content_digest"]
    elif choice == 4:
        key = rng.choice(([], "key", 7, None))  # type: ignore[assignment]
    else:
        key["content_digest"] = "f" * rng.randrange(MAX_HUGE)
    return key


def generate(rng: random.Random) -> Case:
    """One malformed (or, one time in twenty, valid) input."""
    kind = rng.choices(
        ["random_bytes", "oversized", "negative", "truncated", "not_utf8", "not_json",
         "not_object", "wrong_types", "unknown_cmd", "unknown_field", "huge_string",
         "deep_nesting", "bad_key", "junk", "valid"],
        weights=[8, 4, 4, 8, 5, 6, 5, 14, 8, 8, 3, 2, 10, 8, 5],
    )[0]
    if kind == "random_bytes":
        return Case(kind, rng.randbytes(rng.randrange(1, 64)), breaks_stream=True)
    if kind == "oversized":
        n = rng.randrange(MAX_FRAME_BYTES + 1, 2**31)
        return Case(kind, struct.pack(">I", n) + b"{}", breaks_stream=True)
    if kind == "negative":
        # A C reader taking the length as int32 would see it negative.
        return Case(kind, struct.pack(">i", -rng.randrange(1, 2**31)) + b"{}", breaks_stream=True)
    if kind == "truncated":
        whole = _json({"cmd": "stats"})
        return Case(kind, whole[: rng.randrange(1, len(whole))], breaks_stream=True)
    if kind == "not_utf8":
        return Case(kind, _frame(b'{"cmd": "' + rng.randbytes(8).replace(b'"', b"\xff") + b'\xff\xfe"}'))
    if kind == "not_json":
        body = rng.choice((b"{", b"}", b"", b"nan", b"{'cmd': 'stats'}", b'{"cmd": "stats",}',
                           b"\x00\x00", b'{"cmd": NaN}', b"[" * 10 + b"]" * 9))
        return Case(kind, _frame(body))
    if kind == "not_object":
        return Case(kind, _json(rng.choice(([], [{"cmd": "stats"}], "stats", 1, None, True))))
    if kind == "wrong_types":
        cmd = rng.choice(_COMMANDS)
        body: dict[str, object] = {"cmd": cmd}
        if cmd == "hello":
            body.update(protocol=rng.choice(("1", True, None, 1.0, [PROTOCOL_VERSION], PROTOCOL_VERSION + 1, -1)),
                        client=rng.choice((None, 1, [], "fuzz")))
        elif cmd == "get_state":
            body["key"] = rng.choice(("k", 1, None, [], True))
        elif cmd == "attached":
            body.update(rng.choice(_BAD_REPORTS))
        else:
            body[rng.choice(("extra", "cmd2"))] = _junk(rng)
        if rng.random() < 0.3:
            body["cmd"] = rng.choice((1, None, True, ["stats"], {"cmd": "stats"}))
        return Case(kind, _json(body))
    if kind == "unknown_cmd":
        return Case(kind, _json({"cmd": rng.choice(("shutdown", "exec", "eval", "__import__", "STATS",
                                                    "stats ", "get-state", "\u202estats", "x" * 300))}))
    if kind == "unknown_field":
        return Case(kind, _json({"cmd": rng.choice(("stats", "get_memory")), "pickle": "gASVAAAAAAAAAAB9lC4=",
                                 "__class__": "os.system"}))
    if kind == "huge_string":
        n = rng.randrange(1 << 16, MAX_HUGE)
        field = rng.choice(("cmd", "client", "key"))
        body = {"cmd": "hello", "protocol": PROTOCOL_VERSION, "client": "c"}
        if field == "key":
            body = {"cmd": "get_state", "key": {"content_digest": "a" * n}}
        else:
            body[field] = "\u00e9" * (n // 2)
        # A long client name is still a well-formed hello: it must be served.
        return Case(kind, _json(body), valid=field == "client")
    if kind == "deep_nesting":
        depth = rng.randrange(1000, 200_000)
        return Case(kind, _frame(b'{"cmd": "stats", "x": ' + b"[" * depth + b"]" * depth + b"}"))
    if kind == "bad_key":
        return Case(kind, _json({"cmd": "get_state", "key": _bad_key(rng)}))
    if kind == "junk":
        return Case(kind, _json(_junk(rng)))
    return Case(kind, _json(rng.choice(({"cmd": "stats"}, {"cmd": "get_memory"}))), valid=True)


def cases(seed: int, n: int) -> Iterator[Case]:
    rng = random.Random(seed)
    for _ in range(n):
        yield generate(rng)


# ----------------------------------------------------------- the sender


@dataclass
class Tally:
    sent: int = 0
    error_replies: int = 0
    ok_replies: int = 0
    closed: int = 0
    connections: int = 0
    kinds: dict[str, int] | None = None


def _read_replies(sock: socket.socket, out: list[dict], done: threading.Event) -> None:
    """Collect reply frames until EOF (runs beside the sender: no deadlock)."""
    buf = b""
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 4:
                (n,) = struct.unpack(">I", buf[:4])
                if len(buf) < 4 + n:
                    break
                out.append(json.loads(buf[4 : 4 + n]))
                buf = buf[4 + n :]
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        if buf:
            out.append({"status": "__partial__", "bytes": len(buf)})
        done.set()


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


def run_batch(sock: socket.socket, batch: list[Case], tally: Tally, stray_fd: int | None) -> list[Case]:
    """Pipeline ``batch`` on one connection; return the cases it never
    reached (the connection closed before them), to be sent again."""
    tally.connections += 1
    replies: list[dict] = []
    done = threading.Event()
    reader = threading.Thread(target=_read_replies, args=(sock, replies, done), daemon=True)
    reader.start()
    try:
        for i, case in enumerate(batch):
            if i == 0 and stray_fd is not None:
                # A descriptor the daemon never asked for rides with the first frame.
                socket.send_fds(sock, [case.data[:1]], [stray_fd])
                sock.sendall(case.data[1:])
            else:
                sock.sendall(case.data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon closed on us: allowed; the reader tells how far it got
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    assert done.wait(60), "daemon neither answered nor closed within 60 s"
    sock.close()
    # Replies come in request order, one per case the daemon read; the one
    # that made it close may get an error answer or none.
    for reply, case in zip(replies, batch, strict=False):
        assert isinstance(reply, dict), (case.kind, reply)
        if case.valid:
            assert reply.get("status") == "ok", (case.kind, reply)
            tally.ok_replies += 1
        else:
            # Refused: an error naming the problem, or (a well-typed key for
            # other weights) a mismatch naming the fields. Never "ok".
            status = reply.get("status")
            assert status in ("error", "mismatch"), f"{case.kind} got {reply}: a bad frame must be refused"
            if status == "error":
                assert isinstance(reply.get("error"), str) and reply["error"], reply
            else:
                assert reply.get("fields"), (case.kind, reply)
            tally.error_replies += 1
    assert len(replies) <= len(batch), f"more replies than requests: {replies[len(batch):]}"
    tally.sent += len(replies)
    rest = batch[len(replies) :]
    if len(replies) < len(batch):
        tally.closed += 1
    if not replies and rest:
        # Closed without a word at the head of a fresh connection: that case
        # is why; the others go again.
        tally.sent += 1
        return rest[1:]
    if rest and rest[0].breaks_stream and len(rest) == 1:
        tally.sent += 1  # a stream breaker answered by a close alone
        return []
    return rest


def fuzz(path: Path, seed: int, n: int, stray_fd: int | None = None) -> Tally:
    tally = Tally(kinds={})
    pending: list[Case] = []
    stream = cases(seed, n)
    exhausted = False
    while not exhausted or pending:
        batch = pending[:32]
        pending = pending[32:]
        while len(batch) < 32 and not exhausted:
            case = next(stream, None)
            if case is None:
                exhausted = True
                break
            assert tally.kinds is not None
            tally.kinds[case.kind] = tally.kinds.get(case.kind, 0) + 1
            batch.append(case)
            if case.breaks_stream:
                break
        if not batch:
            continue
        # A stream breaker must be last: put any that are not at the end back.
        breakers = [c for c in batch[:-1] if c.breaks_stream]
        batch = [c for c in batch[:-1] if not c.breaks_stream] + batch[-1:]
        pending = breakers + pending
        pending = run_batch(connect(path), batch, tally, stray_fd if tally.connections % 50 == 0 else None) + pending
    return tally


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawDaemon]:
    base = tmp_path_factory.mktemp("fuzz")
    with promoted_daemon(fresh_checkpoint(base / "ckpt", seed=7), base / "cache", expect_digest=False) as d:
        yield d


def test_generator_is_seeded_and_covers_every_kind() -> None:
    a = [c.data for c in cases(SEED, 300)]
    b = [c.data for c in cases(SEED, 300)]
    assert a == b
    kinds = {c.kind for c in cases(SEED, 2000)}
    assert len(kinds) == 15, kinds


def test_reply_checker_catches_a_daemon_that_accepts_garbage() -> None:
    """Control: run_batch fails when a bad frame is answered "ok"."""
    server, client = socket.socketpair()

    def accept_everything() -> None:
        server.settimeout(10)
        while server.recv(1 << 16):
            pass
        server.sendall(_json({"status": "ok"}))
        server.close()

    t = threading.Thread(target=accept_everything)
    t.start()
    with pytest.raises(AssertionError, match="a bad frame must be refused"):
        run_batch(client, [Case("unknown_cmd", _json({"cmd": "exec"}))], Tally(), None)
    t.join(10)


def test_ten_thousand_malformed_frames(daemon: RawDaemon) -> None:
    fds_before, threads_before = open_fds(daemon.proc.pid), thread_count(daemon.proc.pid)
    stray = os.open("/dev/null", os.O_RDONLY)
    t0 = time.monotonic()
    try:
        tally = fuzz(daemon.socket, SEED, N_FRAMES, stray_fd=stray)
    finally:
        os.close(stray)
    seconds = time.monotonic() - t0
    print(f"fuzz: seed={SEED} frames={tally.sent} errors={tally.error_replies} ok={tally.ok_replies} "
          f"closed={tally.closed} connections={tally.connections} seconds={seconds:.1f} kinds={tally.kinds}")
    assert daemon.alive(), f"daemon died under fuzzing (seed {SEED}):\n{daemon.stderr()}"
    assert tally.sent >= N_FRAMES
    assert tally.error_replies > 0 and tally.closed > 0 and tally.ok_replies > 0
    # No leak: connection threads end and every stray descriptor is closed.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        open_fds(daemon.proc.pid) > fds_before + 2 or thread_count(daemon.proc.pid) > threads_before + 2
    ):
        time.sleep(0.2)
    assert open_fds(daemon.proc.pid) <= fds_before + 2, "daemon leaks descriptors"
    assert thread_count(daemon.proc.pid) <= threads_before + 2, "daemon leaks connection threads"
    assert "Traceback" not in daemon.stderr(), daemon.stderr()[-4000:]
    # And it still serves the right weights.
    assert served_tensor_digests(daemon) == checkpoint_tensor_digests(daemon.checkpoint)


def test_deep_nesting_is_a_protocol_error() -> None:
    """Regression (found by this fuzzer): json.loads raises RecursionError on
    deep nesting, which escaped decode() and killed the connection's thread
    with a traceback. It is a bad frame like any other."""
    from pgbase.errors import ProtocolError
    from preload.protocol import decode

    with pytest.raises(ProtocolError, match="nests JSON too deeply"):
        decode(b'{"cmd": "stats", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
