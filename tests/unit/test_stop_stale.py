"""``stop`` removes the stale sockets a daemon killed -9 left (issue 39).

A real socket file nobody listens on, its lock free (what ``kill -9`` of a
rank leaves), found by the real ``status`` scan; the store is absent. The
control puts the old rule back (nothing removed): ``status`` still lists it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from preload.daemon import fdstore
from preload_gate.cli import main

pytestmark = pytest.mark.unit

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()


def _stale_socket(root: Path, digest: str) -> Path:
    import socket as socket_mod

    d = root / digest[:16]
    d.mkdir(mode=0o700, parents=True)
    path = d / "rank0.sock"
    s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # what a daemon killed -9 leaves: the file, nobody listening, the lock free
    return path


@pytest.mark.parametrize("remove", [True, False], ids=["fixed", "control_old_rule"])
def test_a_stale_socket_is_removed_by_stop(tmp_path: Path, monkeypatch, capsys, remove: bool) -> None:
    """Issue 39: after a kill -9, ``stop DIGEST`` removes the stale socket so status no
    longer lists it; the control (the old rule: nothing removed) leaves it listed."""
    from preload.daemon import stop as stop_mod

    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fdstore, "open_store", lambda root, start=True: None)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    sock = _stale_socket(root, A)
    if not remove:
        monkeypatch.setattr(stop_mod, "_remove_stale", lambda records: [])
    assert main(["status", "--socket-root", str(root)]) == 0
    assert f"{sock}: not answering and its lock is free (stale socket)" in capsys.readouterr().out
    assert main(["stop", A[:16], "--socket-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert (f"removed stale socket {sock}" in out) is remove
    main(["status", "--socket-root", str(root)])
    listed = "stale socket" in capsys.readouterr().out
    assert listed is not remove
    assert sock.exists() is not remove and (sock.parent.exists() is not remove)


def test_a_stale_socket_of_another_digest_is_kept(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fdstore, "open_store", lambda root, start=True: None)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    mine, other = _stale_socket(root, A), _stale_socket(root, B)
    assert main(["stop", A, "--socket-root", str(root)]) == 0
    assert not mine.exists() and other.exists()
