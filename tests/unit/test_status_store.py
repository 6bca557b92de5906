"""``preload-gate status`` lists the fd store of each root (issue 26).

The store is a fake :class:`~preload.daemon.fdstore.FdStore` put where
``open_store`` is (the keeper lands in its own branch); each row has its
neighbour: held vs orphan, a store vs none, a store that fails to list.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from preload.daemon import fdstore
from preload.daemon.fdstore import FdStore, FdStoreError, StoredArena
from preload_gate.cli import main

pytestmark = pytest.mark.unit

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()


class FakeStore(FdStore):
    name = "keeper"

    def __init__(self, arenas: list[dict[str, Any]], fail: bool = False) -> None:
        self.arenas, self.fail, self.closed = arenas, fail, False

    def deposit(self, record: Any, fds: list[int]) -> None:
        raise AssertionError("status deposits nothing")

    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        raise AssertionError("status fetches nothing (a fetch hands out fds)")

    def release(self, digest: str, global_rank: int) -> None:
        raise AssertionError("status releases nothing")

    def drop(
        self, digest: str | None = None, global_rank: int | None = None
    ) -> list[dict[str, Any]]:
        raise AssertionError("status drops nothing")

    def list(self) -> list[dict[str, Any]]:
        if self.fail:
            raise FdStoreError("the keeper answered a bad frame")
        return list(self.arenas)

    def close(self) -> None:
        self.closed = True


def _arena(
    digest: str, rank: int, held: bool, ttl_left: float | None = None, **extra: Any
) -> dict[str, Any]:
    out = {
        "digest": digest,
        "rank": rank,
        "stage": "loaded",
        "transport": "shm",
        "bytes": 1000 * (rank + 1),
        "tensors": 3,
        "daemon_id": "d",
        "pid": 4242,
        "deposited_at": time.time(),
        "origin": "adopted",
        "generation": 2,
        "checkpoint": "/models/m",
        "held": held,
        **extra,
    }
    if ttl_left is not None:
        out["ttl_left_s"] = ttl_left
    return out


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    r = tmp_path / "root"
    r.mkdir(mode=0o700)
    return r


def _use(monkeypatch: pytest.MonkeyPatch, store: FdStore | None, asked: list | None = None) -> None:
    def open_store(socket_root: str | None, start: bool = True) -> FdStore | None:
        if asked is not None:
            asked.append((socket_root, start))
        return store

    monkeypatch.setattr(fdstore, "open_store", open_store)


def test_status_lists_held_and_orphan_arenas_with_sizes(root: Path, monkeypatch, capsys) -> None:
    store = FakeStore(
        [
            _arena(B, 0, held=False, ttl_left=3540.4),
            _arena(A, 1, held=True),
            _arena(A, 0, held=False, unknown_field="ignored"),
        ]
    )
    asked: list = []
    _use(monkeypatch, store, asked)
    assert main(["status", "--socket-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert asked == [(str(root), False)] and store.closed  # never starts a keeper
    assert f"fd store (keeper) of {root}: 3 arena(s), 4000 bytes" in out
    lines = out.splitlines()
    i = lines.index(f"fd store (keeper) of {root}: 3 arena(s), 4000 bytes")
    assert B < A  # listed by digest, then rank
    gone = "        folder missing: its folder /models/m is gone: no engine started on that path can use this arena; "
    assert lines[i + 1 : i + 7] == [
        f"    {B[:16]} rank 0 loaded/shm 1000 bytes, adopted gen 2, orphan (3540 s of its TTL left)  /models/m",
        gone + f"run: restore /models/m, or free the arena: preload-gate stop {B[:16]}",
        f"    {A[:16]} rank 0 loaded/shm 1000 bytes, adopted gen 2, orphan (kept until preload-gate stop)  /models/m",
        gone + f"run: restore /models/m, or free the arena: preload-gate stop {A[:16]}",
        f"    {A[:16]} rank 1 loaded/shm 2000 bytes, adopted gen 2, held by pid 4242  /models/m",
        gone + f"run: restore /models/m, or free the arena: preload-gate stop {A[:16]}",
    ]
    assert "no preload daemons found" in out  # the store's arenas outlive their daemons


def test_status_json_carries_the_store(root: Path, monkeypatch, capsys) -> None:
    _use(monkeypatch, FakeStore([_arena(A, 0, held=False, ttl_left=12.0)]))
    assert main(["status", "--socket-root", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stores"] == [{"socket_root": str(root), "store": "keeper", "error": None, "state": "running"}]
    (a,) = doc["stored"]
    assert (
        a["digest"],
        a["rank"],
        a["stage"],
        a["transport"],
        a["bytes"],
        a["origin"],
        a["generation"],
        a["held"],
        a["ttl_left_s"],
        a["checkpoint"],
        a["store"],
    ) == (A, 0, "loaded", "shm", 1000, "adopted", 2, False, 12.0, "/models/m", "keeper")


def test_no_store_is_said_as_none_runs(root: Path, monkeypatch, capsys) -> None:
    """Issue 39: a missing store is said, never shown as nothing."""
    _use(monkeypatch, None)
    assert main(["status", "--socket-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"fd store of {root}: none runs (no keeper): no arena outlives its daemon here" in out
    assert "note:" not in out
    assert main(["status", "--socket-root", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["stores"] == [{"socket_root": str(root), "store": None, "error": None, "state": "none"}]
        and doc["stored"] == []
    )


def test_a_store_that_fails_to_list_is_a_note_not_a_failure(
    root: Path, monkeypatch, capsys
) -> None:
    store = FakeStore([_arena(A, 0, held=True)], fail=True)
    _use(monkeypatch, store)
    assert main(["status", "--socket-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"note: cannot list the fd store of {root}: the keeper answered a bad frame" in out
    assert store.closed


def test_a_store_that_cannot_be_reached_is_a_note(root: Path, monkeypatch, capsys) -> None:
    def open_store(socket_root: str | None, start: bool = True) -> FdStore | None:
        raise FdStoreError(f"{socket_root}/keeper.sock is not ours")

    monkeypatch.setattr(fdstore, "open_store", open_store)
    assert main(["status", "--socket-root", str(root)]) == 0
    assert (
        f"note: cannot list the fd store of {root}: {root}/keeper.sock is not ours"
        in capsys.readouterr().out
    )


def _dead_keeper_socket(root: Path) -> Path:
    """What a keeper killed -9 leaves: its socket file, nobody listening."""
    import socket

    path = root / "keeper.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    return path


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_an_unreachable_keeper_is_said_as_such(root: Path, monkeypatch, capsys, fixed: bool) -> None:
    """Issue 39: a keeper whose socket is there and answers nothing (killed) is UNREACHABLE,
    with what is lost; the control (the old rule: nobody asks whether the socket is there)
    shows it as no store at all."""
    _dead_keeper_socket(root)
    if not fixed:
        monkeypatch.setattr(fdstore, "keeper_state", lambda root: "absent")
    assert main(["status", "--socket-root", str(root)]) == 0
    out = capsys.readouterr().out
    said = (f"fd store of {root}: UNREACHABLE: {root}/keeper.sock is there but no keeper answers (it died, "
            "e.g. kill -9): every arena it held is lost") in out
    assert said is fixed, out
    assert main(["status", "--socket-root", str(root), "--json"]) == 0
    (st,) = json.loads(capsys.readouterr().out)["stores"]
    assert st["state"] == ("unreachable" if fixed else "none")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_a_keeper_that_accepts_and_never_answers_is_unreachable_not_none(root: Path, monkeypatch, capsys,
                                                                         fixed: bool) -> None:
    """A stopped keeper (SIGSTOP, a debugger) still holds its arenas and its
    socket accepts into the backlog, but never answers: status says so, not
    "none runs" (review finding). The control is the old rule, which fell
    through to "none" whenever no store could be opened."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(root / "keeper.sock"))
    listener.listen(8)  # accepts into the backlog; nobody ever answers
    monkeypatch.setattr(fdstore, "open_store", lambda *a, **k: None)  # its hello timed out
    if not fixed:
        monkeypatch.setattr(fdstore, "keeper_state", lambda root: "absent")
    try:
        assert main(["status", "--socket-root", str(root), "--json"]) == 0
        (st,) = json.loads(capsys.readouterr().out)["stores"]
    finally:
        listener.close()
    assert (st["state"] == "unreachable" and "does not answer" in (st.get("error") or "")) is fixed, st
