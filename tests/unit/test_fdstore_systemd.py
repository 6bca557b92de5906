"""systemd's fd store (issue 26), against a fake service manager that does what systemd does.

The fake binds a datagram socket as ``$NOTIFY_SOCKET`` (a path, or an
abstract ``@`` name), keeps the fds sent with ``FDSTORE=1`` under their
``FDNAME=`` and removes them on ``FDSTOREREMOVE=1`` (both as
``src/core/service.c`` does: a bad name is ignored with its fds closed),
then starts the "next invocation" as systemd does on a restart: the fds at
3.. in the order stored, ``LISTEN_FDS``/``LISTEN_FDNAMES`` set and
``LISTEN_PID`` the new process's own pid (set after the fork, before
exec: here by a trampoline that execs the child). PID 1 here is not
systemd (``ps -p 1``), so no real unit runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preload.daemon.arena_record import ArenaRecord
from preload.daemon.fdstore import FdStoreError
from preload.daemon.fdstore_systemd import (
    FDNAME_MAX,
    HANDOFF_FDS_ENV,
    RECORD_SEALS,
    SystemdStore,
    check_fdname,
    fd_names,
    notify_ready,
    sd_notify,
    take_listen_fds,
)

pytestmark = pytest.mark.unit

DIGEST = hashlib.sha256(b"checkpoint").hexdigest()
REPO = Path(__file__).resolve().parents[2]
_SEALS = 0x1 | 0x2 | 0x4 | 0x8


def _record(rank: int = 0, nfds: int = 1, ttl: float = 3600.0, digest: str = DIGEST) -> ArenaRecord:
    return ArenaRecord(
        digest=digest,
        global_rank=rank,
        key={"content_digest": digest},
        stage="loaded",
        transport="shm",
        descriptor={"kind": "shm"},
        nfds=nfds,
        entries=[{"name": "w", "offset": 0, "nbytes": 4096}],
        total_bytes=4096 * nfds,
        daemon_id="d1",
        pid=os.getpid(),
        deposited_at=time.time(),
        checkpoint="/ckpt",
        orphan_ttl_s=ttl,
    )


def _arena(payload: bytes) -> int:
    """A sealed memfd, as ShmArena seals it."""
    fd = os.memfd_create("arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, payload)
    fcntl.fcntl(fd, 1033, _SEALS)
    return fd


class FakeServiceManager:
    """The service manager's side of the fd store, as systemd implements it."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)
        self.address = address
        self.store: list[tuple[str, int]] = []  # (name, fd) in arrival order
        self.messages: list[dict[str, str]] = []

    @property
    def notify_socket(self) -> str:
        return "@" + self.address[1:] if self.address.startswith("\0") else self.address

    def pump(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 64)
            except BlockingIOError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)
            name = fields.get("FDNAME", "stored")
            valid = (
                len(name) <= FDNAME_MAX and ":" not in name and all(" " <= c < "\x7f" for c in name)
            )
            if fields.get("FDSTORE") == "1" and valid:
                self.store += [(name, fd) for fd in fds]
                continue
            for fd in fds:
                os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1" and valid:
                for n, fd in [x for x in self.store if x[0] == name]:
                    os.close(fd)
                    self.store.remove((n, fd))

    def names(self) -> list[str]:
        self.pump()
        return [n for n, _ in self.store]

    def restart(
        self, code: str, listen_pid: str = "self", extra_env: dict[str, str] | None = None
    ) -> dict:
        """Start the next invocation with the stored fds at 3..; returns its JSON line."""
        self.pump()
        env = {
            **os.environ,
            "NOTIFY_SOCKET": self.notify_socket,
            "PYTHONPATH": str(REPO),
            "LISTEN_FDS": str(len(self.store)),
            "LISTEN_FDNAMES": ":".join(n for n, _ in self.store),
            **(extra_env or {}),
        }
        src = [fd for _, fd in self.store]
        # The fork side of systemd: the fds at 3.. in order, LISTEN_PID set, then exec.
        trampoline = (
            "import os, sys, json\n"
            "src = json.loads(sys.argv[1])\n"
            "for i, fd in enumerate(src):\n"
            "    os.dup2(fd, 3 + i)\n"
            "    os.close(fd)\n"
            "os.environ['LISTEN_PID'] = str(os.getpid()) if sys.argv[2] == 'self' else sys.argv[2]\n"
            "os.execv(sys.executable, [sys.executable, '-c', sys.argv[3]])\n"
        )
        # Above every target number, so no source is overwritten by an earlier dup2.
        floor = 3 + len(src) + 64
        raised = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in src]
        for fd in raised:
            os.set_inheritable(fd, True)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", trampoline, json.dumps(raised), listen_pid, code],
                env=env,
                pass_fds=raised,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            for fd in raised:
                os.close(fd)
        assert proc.returncode == 0, proc.stderr
        self.pump()
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for _, fd in self.store:
            os.close(fd)
        self.sock.close()
        if not self.address.startswith("\0"):
            os.unlink(self.address)


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, tmp_path: Path):
    addr = (
        str(tmp_path / "notify.sock")
        if request.param == "path"
        else f"\0pg-test-{os.getpid()}-{time.time_ns()}"
    )
    m = FakeServiceManager(addr)
    yield m
    m.close()


CHILD_FETCH = f"""
import hashlib, json, os
from preload.daemon.fdstore_systemd import SystemdStore
store = SystemdStore.from_environment()
out = {{"listed": store.list(), "env_left": [k for k in os.environ if k.startswith("LISTEN_")]}}
got = store.fetch({DIGEST!r}, 0)
if got is not None:
    out["record"] = got.record.to_json()
    out["sha"] = [hashlib.sha256(os.pread(fd, os.fstat(fd).st_size, 0)).hexdigest() for fd in got.fds]
print(json.dumps(out))
"""


def test_deposit_survives_a_restart_and_the_successor_reads_equal_bytes(
    manager: FakeServiceManager,
) -> None:
    payloads = [b"arena-0" * 1000, b"arena-1" * 333]
    fds = [_arena(p) for p in payloads]
    store = SystemdStore(manager.notify_socket)
    rec = _record(nfds=2)
    store.deposit(rec, fds)
    for fd in fds:
        os.close(fd)  # the depositor dies: only the manager holds them now
    store.close()
    names, rec_name = fd_names(DIGEST, 0, 2)
    assert manager.names() == [*names, rec_name]
    assert all(m.get("FDPOLL") == "0" for m in manager.messages if m.get("FDSTORE") == "1")

    out = manager.restart(CHILD_FETCH)
    assert out["sha"] == [hashlib.sha256(p).hexdigest() for p in payloads]
    assert ArenaRecord.from_json(out["record"]) == rec
    assert out["listed"][0]["held"] is False and out["listed"][0]["ttl_left_s"] > 0
    assert out["env_left"] == []  # sd_listen_fds(unset): no child adopts them again


def test_listen_pid_of_another_process_adopts_nothing(manager: FakeServiceManager) -> None:
    fd = _arena(b"x" * 64)
    SystemdStore(manager.notify_socket).deposit(_record(), [fd])
    os.close(fd)
    assert "sha" in manager.restart(CHILD_FETCH)  # the neighbour: its own pid adopts
    out = manager.restart(CHILD_FETCH, listen_pid="1")
    assert "sha" not in out and out["listed"] == []


def test_the_launcher_hands_inherited_fds_to_its_ranks(manager: FakeServiceManager) -> None:
    fd = _arena(b"rank-bytes" * 10)
    SystemdStore(manager.notify_socket).deposit(_record(), [fd])
    os.close(fd)
    code = f"""
import json, os, subprocess, sys
from preload.daemon.fdstore_systemd import take_listen_fds
inh = take_listen_fds()
env = {{**os.environ, **inh.child_env()}}
child = {CHILD_FETCH!r}
ok = subprocess.run([sys.executable, "-c", child], env=env, pass_fds=inh.all_fds(), capture_output=True, text=True)
# a process the launcher did not start (its parent pid differs) adopts nothing
hop = "import json, subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], pass_fds=json.loads(sys.argv[2]))"
other = subprocess.run([sys.executable, "-c", hop, child, json.dumps(inh.all_fds())], env=env,
                       pass_fds=inh.all_fds(), capture_output=True, text=True)
print(json.dumps({{"ok": json.loads(ok.stdout), "other": json.loads(other.stdout)}}))
"""
    out = manager.restart(code)
    assert out["ok"]["sha"] == [hashlib.sha256(b"rank-bytes" * 10).hexdigest()]
    assert "sha" not in out["other"]


def test_deposit_replaces_and_release_removes_from_the_manager(manager: FakeServiceManager) -> None:
    store = SystemdStore(manager.notify_socket)
    a, b = _arena(b"a" * 10), _arena(b"b" * 10)
    store.deposit(_record(), [a])
    store.deposit(_record(), [b])  # same digest and rank: replaces
    names, rec_name = fd_names(DIGEST, 0, 1)
    assert manager.names() == [*names, rec_name]
    out = manager.restart(CHILD_FETCH)
    assert out["sha"] == [hashlib.sha256(b"b" * 10).hexdigest()]
    other = _record(rank=1)
    store.deposit(other, [a])
    store.release(DIGEST, 0)
    assert manager.names() == [*fd_names(DIGEST, 1, 1)[0], fd_names(DIGEST, 1, 1)[1]]
    dropped = store.drop(DIGEST)
    assert [d["rank"] for d in dropped] == [1] and manager.names() == []
    os.close(a)
    os.close(b)


def test_an_unsealed_or_incomplete_record_is_not_adopted(manager: FakeServiceManager) -> None:
    fd = _arena(b"z" * 32)
    SystemdStore(manager.notify_socket).deposit(_record(), [fd])
    os.close(fd)
    assert "sha" in manager.restart(CHILD_FETCH)  # the neighbour: the sealed record
    # Control: the record's memfd swapped for an unsealed one holding the same JSON.
    i = next(i for i, (n, _) in enumerate(manager.store) if n.endswith("-rec"))
    name, sealed = manager.store[i]
    plain = os.memfd_create("rec", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(plain, os.pread(sealed, 1 << 20, 0))
    os.close(sealed)
    manager.store[i] = (name, plain)
    out = manager.restart(CHILD_FETCH)
    assert "sha" not in out and out["listed"] == []
    assert manager.names() == []  # and the refused arena is dropped from the store


def test_an_arena_missing_an_fd_is_not_adopted(manager: FakeServiceManager) -> None:
    fds = [_arena(b"p"), _arena(b"q")]
    SystemdStore(manager.notify_socket).deposit(_record(nfds=2), fds)
    for fd in fds:
        os.close(fd)
    manager.pump()
    name, lost = manager.store.pop(1)  # FileDescriptorStoreMax= reached: one fd never stored
    os.close(lost)
    out = manager.restart(CHILD_FETCH)
    assert "sha" not in out and out["listed"] == []


def test_an_orphan_past_its_ttl_is_dropped(manager: FakeServiceManager) -> None:
    fd = _arena(b"t")
    SystemdStore(manager.notify_socket).deposit(_record(ttl=0.2), [fd])
    os.close(fd)
    # The successor waits past the TTL before it looks: the orphan is gone.
    code = CHILD_FETCH.replace(
        "store = SystemdStore.from_environment()\n",
        "store = SystemdStore.from_environment()\nimport time; time.sleep(0.5)\n",
    )
    assert code != CHILD_FETCH
    out = manager.restart(code)
    assert "sha" not in out and out["listed"] == []
    assert manager.names() == []


@pytest.mark.parametrize(
    "name, ok",
    [
        ("pg-" + "a" * 32 + "-r0-rec", True),
        ("x" * FDNAME_MAX, True),
        ("x" * (FDNAME_MAX + 1), False),
        ("pg:a", False),
        ("tab\there", False),
        ("é", False),
    ],
)
def test_fdname_rules(name: str, ok: bool) -> None:
    if ok:
        assert check_fdname(name) == name
    else:
        with pytest.raises(FdStoreError):
            check_fdname(name)


def test_a_name_with_a_colon_is_refused_before_it_is_sent(manager: FakeServiceManager) -> None:
    fd = _arena(b"c")
    sd_notify("FDSTORE=1\nFDNAME=fine", [fd], manager.notify_socket)  # the neighbour arrives
    with pytest.raises(FdStoreError, match="':'"):
        sd_notify("FDSTORE=1\nFDNAME=a:b", [fd], manager.notify_socket)
    assert manager.names() == ["fine"]
    os.close(fd)


def test_ready_is_sent_when_a_manager_listens(manager: FakeServiceManager) -> None:
    assert notify_ready("serving x", {"NOTIFY_SOCKET": manager.notify_socket})
    manager.pump()
    assert manager.messages[-1]["READY"] == "1" and manager.messages[-1]["MAINPID"] == str(
        os.getpid()
    )
    assert not notify_ready("serving x", {})


def test_bad_environment_is_one_clear_error() -> None:
    with pytest.raises(FdStoreError, match="NOTIFY_SOCKET is not set"):
        SystemdStore.from_environment({})
    with pytest.raises(FdStoreError, match="vsock"):
        SystemdStore("vsock:2:1234")
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "two"}
    with pytest.raises(FdStoreError, match="LISTEN_FDS"):
        take_listen_fds(env)
    assert env == {}
    assert take_listen_fds({HANDOFF_FDS_ENV: "3"}).fds == {}  # no parent pid: not ours


def test_record_seals_are_the_shm_arena_seals() -> None:
    from preload.transports.shm import SEALS

    assert RECORD_SEALS == SEALS


def test_open_store_picks_systemds_store_under_the_unit_and_the_keeper_otherwise(tmp_path, monkeypatch):
    """The shipped unit's environment selects SystemdStore; without PRELOAD_GATE_FDSTORE it is the keeper's."""
    from preload.daemon import fdstore
    from preload.daemon.fdstore_systemd import SystemdStore

    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
        monkeypatch.setenv(fdstore.FDSTORE_ENV, "systemd")
        assert isinstance(fdstore.open_store(str(tmp_path / "root"), start=False), SystemdStore)
        monkeypatch.delenv(fdstore.FDSTORE_ENV)  # control: no unit setting, no systemd store
        assert not isinstance(fdstore.open_store(str(tmp_path / "root"), start=False), SystemdStore)
    finally:
        sock.close()
