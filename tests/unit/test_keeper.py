"""The keeper (issue 26): an fd store of ours that outlives the daemons it serves.

Every test starts a real keeper process (through :class:`KeeperStore`, as
a daemon does) on a socket root of its own, and checks one rule with a
control beside it:

- a deposited sealed memfd comes back from a fetch with equal bytes, held;
- the keeper process maps no torch (its /proc/PID/maps; control: this
  process, which imports torch, does) and importing it loads no torch;
- a peer of another uid is hung up on (control: the same client as us);
- a garbage frame gets an error reply, and the keeper keeps serving;
- an orphan is dropped after its TTL while a longer-lived one stays;
- a deposit past MAX_ARENAS is refused by name, a replacement is not;
- a depositor killed -9 leaves its arena as an orphan, bytes intact;
- two racing starters start one keeper; an empty keeper exits when idle,
  one holding an arena does not.

Waits are bounded polls, never timing claims.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import process_gone, repo_pythonpath, short_dir, wait_for
from reliability_support import NOBODY, run_as, setpriv_reason, skip_privileged

from preload.daemon import keeper
from preload.daemon.arena_record import ArenaRecord
from preload.daemon.fdstore import MAX_ARENAS, FdStoreError, KeeperStore, open_store
from preload.transports.shm import F_ADD_SEALS, SEALS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

BOUND_S = 30.0
DIGEST = "ab" * 32


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("keeper-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    return fd


def _record(digest: str = DIGEST, rank: int = 0, size: int = 4096, ttl: float = 3600.0) -> ArenaRecord:
    return ArenaRecord(digest=digest, global_rank=rank, key={"content_digest": digest}, stage="raw",
                       transport="shm", descriptor={"kind": "shm", "size": size}, nfds=1,
                       entries=[], total_bytes=size, daemon_id="test", pid=os.getpid(),
                       deposited_at=time.time(), orphan_ttl_s=ttl)


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A socket root of its own; its keeper is stopped (SIGTERM by pid) after the test."""
    monkeypatch.setenv("PRELOAD_GATE_KEEPER_IDLE_S", "1")
    r = short_dir("pg-keep-")
    yield r
    path = keeper.socket_file(r)
    if os.path.exists(path):
        try:
            s = KeeperStore(r, start=False)
        except FdStoreError:
            s = None
        if s is not None:
            pid = s.keeper_pid
            s.drop()
            s.close()
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: process_gone(pid), BOUND_S)
    shutil.rmtree(r, ignore_errors=True)


def test_deposit_then_fetch_gives_the_same_bytes(root: Path) -> None:
    data = os.urandom(4096)
    store = open_store(root)
    assert isinstance(store, KeeperStore) and store.name == "keeper"
    fd = _memfd(data)
    store.deposit(_record(), [fd])
    os.close(fd)  # the keeper holds its own copy
    got = store.fetch(DIGEST, 0)
    assert got is not None and got.held is True
    assert got.record == _record().__class__.from_json(got.record.to_json())
    assert _read(got.fds[0]) == data
    for f in got.fds:
        os.close(f)
    assert [a["rank"] for a in store.list()] == [0]
    # Control: another rank, another digest: nothing.
    assert store.fetch(DIGEST, 1) is None and store.fetch("cd" * 32, 0) is None
    # Released by its depositor: gone.
    store.release(DIGEST, 0)
    assert store.fetch(DIGEST, 0) is None
    store.close()


def test_keeper_maps_no_torch(root: Path) -> None:
    store = open_store(root)
    assert isinstance(store, KeeperStore)
    fd = _memfd(b"x" * 4096)
    store.deposit(_record(), [fd])
    os.close(fd)
    maps = Path(f"/proc/{store.keeper_pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps
    # Control: this process imported torch (through the shm transport) and maps it.
    assert "torch" in sys.modules and "libtorch" in Path("/proc/self/maps").read_text()
    # Importing the keeper and the store loads no torch.
    out = subprocess.run([sys.executable, "-c", "import sys, preload.daemon.keeper, preload.daemon.fdstore;"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert out.stdout.strip() == "False", out.stderr
    store.close()


PEER = textwrap.dedent("""
    import json, os, socket, struct, sys
    out = {"uid": os.getuid()}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(sys.argv[1])
        out["connected"] = True
        body = json.dumps({"cmd": "list"}).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        head = s.recv(4)
        if not head:
            out["closed"] = True
        else:
            n = struct.unpack(">I", head)[0]
            data = b""
            while len(data) < n:
                data += s.recv(n - len(data))
            out["reply"] = json.loads(data)
    except (ConnectionResetError, BrokenPipeError):  # hung up on, before or after our request
        out["closed"] = True
    except OSError as exc:
        out["error"] = repr(exc)
    print(json.dumps(out))
""")


def test_other_uid_is_hung_up_on(root: Path) -> None:
    reason = setpriv_reason()
    if reason:
        skip_privileged(f"cannot run a client as another uid here: {reason}")
    store = open_store(root)
    assert store is not None
    # The other uid reaches the socket (run_as keeps CAP_DAC_OVERRIDE past the 0700 modes)...
    hostile = json.loads(run_as(NOBODY, [sys.executable, "-c", PEER, str(keeper.socket_file(root))])
                         .stdout.strip().splitlines()[-1])
    assert hostile["uid"] == NOBODY
    assert hostile.get("connected") and hostile.get("closed") is True and "reply" not in hostile, hostile
    assert wait_for(lambda: f"uid {NOBODY}" in (root / keeper.LOG_NAME).read_text(), BOUND_S)
    # Control: the same client as our own uid gets a listing.
    friend = json.loads(run_as(os.getuid(), [sys.executable, "-c", PEER, str(keeper.socket_file(root))])
                        .stdout.strip().splitlines()[-1])
    assert friend.get("reply", {}).get("status") == "ok", friend
    store.close()


def _raw_frame(sock: socket.socket, payload: bytes) -> dict:
    sock.sendall(struct.pack(">I", len(payload)) + payload)
    head = sock.recv(4)
    assert head, "the keeper closed without a reply"
    n = struct.unpack(">I", head)[0]
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk
        data += chunk
    return json.loads(data)


def test_garbage_gets_an_error_reply_and_the_keeper_lives(root: Path) -> None:
    store = open_store(root)
    assert isinstance(store, KeeperStore)
    fd = _memfd(b"k" * 4096)
    store.deposit(_record(), [fd])
    os.close(fd)
    for payload, words in ((b"\xff\xfe not json", "bad frame"),
                           (b'{"cmd": "explode"}', "unknown command 'explode'"),
                           (b'{"cmd": "fetch", "digest": "xyz", "global_rank": 0}', "fetch: "),
                           (b'{"cmd": "deposit", "record": {"digest": 5}}', "deposit refused")):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(keeper.socket_file(root)))
        reply = _raw_frame(s, payload)
        s.close()
        assert reply["status"] == "error" and words in reply["error"], (payload, reply)
    # Still serving, still holding (control: the same keeper answers a good request).
    got = store.fetch(DIGEST, 0)
    assert got is not None and _read(got.fds[0]) == b"k" * 4096
    os.close(got.fds[0])
    # A deposit whose fd count differs from its record's is refused by the keeper, nothing kept.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(keeper.socket_file(root)))
    reply = _raw_frame(s, json.dumps({"cmd": "deposit", "record": _record(rank=3).to_json()}).encode())
    s.close()
    assert reply["status"] == "error" and "the record says 1 fds; 0 came" in reply["error"], reply
    assert store.fetch(DIGEST, 3) is None
    store.close()


def test_an_orphan_expires_after_its_ttl(root: Path) -> None:
    depositor = open_store(root)
    assert depositor is not None
    for rank, ttl in ((0, 0.3), (1, 3600.0)):
        fd = _memfd(bytes([rank]) * 4096)
        depositor.deposit(_record(rank=rank, ttl=ttl), [fd])
        os.close(fd)
    watcher = open_store(root, start=False)
    assert watcher is not None
    assert all(a["held"] for a in watcher.list())
    depositor.close()  # both are orphans now
    assert wait_for(lambda: [a["rank"] for a in watcher.list()] == [1], BOUND_S), watcher.list()
    # Control: the one with the long TTL stays, an orphan, with its bytes.
    (left,) = watcher.list()
    assert left["held"] is False
    got = watcher.fetch(DIGEST, 1)
    assert got is not None and _read(got.fds[0]) == b"\x01" * 4096
    os.close(got.fds[0])
    watcher.close()


def test_a_full_store_refuses_a_new_arena_not_a_replacement(root: Path) -> None:
    store = open_store(root)
    assert store is not None
    fd = _memfd(b"f" * 4096)
    for rank in range(MAX_ARENAS):
        store.deposit(_record(rank=rank), [fd])
    with pytest.raises(FdStoreError, match=f"MAX_ARENAS {MAX_ARENAS}"):
        store.deposit(_record(rank=MAX_ARENAS), [fd])
    assert store.fetch(DIGEST, MAX_ARENAS) is None
    # Control: replacing a stored rank is no new arena.
    store.deposit(_record(rank=0), [fd])
    assert len(store.list()) == MAX_ARENAS
    os.close(fd)
    store.drop()
    store.close()


DEPOSITOR = textwrap.dedent("""
    import fcntl, os, sys, time
    from preload.daemon.fdstore import open_store
    from preload.daemon.arena_record import ArenaRecord
    from preload.transports.shm import F_ADD_SEALS, SEALS
    d = "ab" * 32
    fd = os.memfd_create("dep", os.MFD_ALLOW_SEALING)
    os.write(fd, b"D" * 4096)
    fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    s = open_store(sys.argv[1])
    s.deposit(ArenaRecord(digest=d, global_rank=0, key={"content_digest": d}, stage="raw", transport="shm",
                          descriptor={"kind": "shm", "size": 4096}, nfds=1, entries=[], total_bytes=4096,
                          daemon_id="child", pid=os.getpid(), deposited_at=time.time()), [fd])
    print("deposited", flush=True)
    time.sleep(3600)
""")


def test_a_depositor_killed_9_leaves_an_orphan(root: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", DEPOSITOR, str(root)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "deposited"
        watcher = open_store(root, start=False)
        assert watcher is not None
        # Control: while the depositor lives, its arena is held.
        assert [a["held"] for a in watcher.list()] == [True]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert wait_for(lambda: [a["held"] for a in watcher.list()] == [False], BOUND_S), watcher.list()
    got = watcher.fetch(DIGEST, 0)
    assert got is not None and got.held is False and _read(got.fds[0]) == b"D" * 4096
    assert got.record.pid == child.pid
    os.close(got.fds[0])
    watcher.close()


STARTER = textwrap.dedent("""
    import sys
    from preload.daemon.fdstore import open_store
    print(open_store(sys.argv[1]).keeper_pid, flush=True)
    sys.stdin.read()
""")


def test_racing_starters_start_one_keeper(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    procs = [subprocess.Popen([sys.executable, "-c", STARTER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    try:
        pids = {p.stdout.readline().strip() for p in procs if p.stdout is not None}
    finally:
        for p in procs:
            p.communicate("", timeout=BOUND_S)
    assert len(pids) == 1 and pids != {""}, pids
    # The keeper is in a session of its own: no signal to a starter's group reaches it.
    pid = int(pids.pop())
    assert os.getsid(pid) == pid


def test_an_empty_keeper_exits_a_holding_one_does_not(root: Path) -> None:
    store = open_store(root)
    assert isinstance(store, KeeperStore)
    pid = store.keeper_pid
    fd = _memfd(b"h" * 4096)
    store.deposit(_record(ttl=0), [fd])
    os.close(fd)
    store.close()  # an orphan with no TTL: kept until dropped
    time.sleep(2.5)  # longer than the 1 s idle (a bound, not a claim): it must still be there
    assert not process_gone(pid)
    s = open_store(root, start=False)
    assert s is not None and [a["rank"] for a in s.list()] == [0]
    s.drop()
    s.close()
    assert wait_for(lambda: process_gone(pid), BOUND_S)
    assert not keeper.socket_file(root).exists()
    assert open_store(root, start=False) is None
