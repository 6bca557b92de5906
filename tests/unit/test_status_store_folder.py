"""``status`` tells, per stored arena, whether its folder is still there
with that digest, with the command that fixes it (issue 39).

Real folders (the tiny fixture, promoted), a fake store listing one arena
recorded for them: intact, deleted, re-created at the same path with other
weights (promoted again, or not). The control puts the old rule back (no
folder check): a deleted folder's arena prints the same line as an intact one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from reliability_support import fresh_checkpoint

from preload.daemon import fdstore, status_store
from preload.daemon.fdstore import FdStore, StoredArena
from preload.promote import promote
from preload_gate.cli import main

pytestmark = pytest.mark.unit


class ListingStore(FdStore):
    name = "keeper"

    def __init__(self, arenas: list[dict[str, Any]]) -> None:
        self.arenas = arenas

    def deposit(self, record: Any, fds: list[int]) -> None:
        raise AssertionError

    def fetch(self, digest: str, global_rank: int) -> StoredArena | None:
        raise AssertionError

    def release(self, digest: str, global_rank: int) -> None:
        raise AssertionError

    def drop(self, digest: str | None = None, global_rank: int | None = None) -> list[dict[str, Any]]:
        raise AssertionError

    def list(self) -> list[dict[str, Any]]:
        return list(self.arenas)

    def close(self) -> None:
        pass


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("PRELOAD_GATE_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    ckpt = fresh_checkpoint(tmp_path / "m", seed=5, shards=1)
    digest = promote(ckpt, socket_root=root, progress=False).digest
    arena = {"digest": digest, "rank": 0, "stage": "raw", "transport": "shm", "bytes": 10, "held": False,
             "checkpoint": os.path.realpath(ckpt), "pid": 7, "deposited_at": time.time(), "orphan_ttl_s": 0}
    monkeypatch.setattr(fdstore, "open_store", lambda r, start=True: ListingStore([arena]))
    return {"root": root, "ckpt": Path(os.path.realpath(ckpt)), "digest": digest}


def _status(root: Path, capsys) -> tuple[list[str], dict]:
    assert main(["status", "--socket-root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["status", "--socket-root", str(root), "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)["stored"]
    return lines, a


def _arena_lines(lines: list[str], d16: str) -> list[str]:
    i = next(n for n, line in enumerate(lines) if line.startswith(f"    {d16} rank 0"))
    return [lines[i]] + [x for x in lines[i + 1:i + 2] if x.startswith("        folder")]


def test_an_intact_folder_gets_no_folder_line(world: dict, capsys) -> None:
    lines, a = _status(world["root"], capsys)
    assert len(_arena_lines(lines, world["digest"][:16])) == 1
    assert a["folder"] == "intact" and a["fix"] == ""


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "control_old_rule"])
def test_a_deleted_folder_is_said_with_the_fix(world: dict, capsys, monkeypatch, fixed: bool) -> None:
    before = _arena_lines(_status(world["root"], capsys)[0], world["digest"][:16])
    shutil.rmtree(world["ckpt"])
    if not fixed:  # the old rule: no folder check
        monkeypatch.setattr(status_store, "folder_check", lambda a: ("intact", "", ""))
    lines, a = _status(world["root"], capsys)
    after = _arena_lines(lines, world["digest"][:16])
    if not fixed:
        assert after == before  # the bug: a deleted folder's arena reads like an intact one
        return
    d16 = world["digest"][:16]
    assert after[1] == (f"        folder missing: its folder {world['ckpt']} is gone: no engine started on that path "
                        f"can use this arena; run: restore {world['ckpt']}, or free the arena: preload-gate stop {d16}")
    assert a["folder"] == "missing" and a["fix"].endswith(f"preload-gate stop {d16}")


def test_a_folder_recreated_with_other_weights_and_promoted_is_changed(world: dict, capsys) -> None:
    shutil.rmtree(world["ckpt"])
    fresh_checkpoint(world["ckpt"], seed=6, shards=1)
    other = promote(world["ckpt"], socket_root=world["root"], progress=False).digest
    assert other != world["digest"]
    lines, a = _status(world["root"], capsys)
    d16 = world["digest"][:16]
    assert _arena_lines(lines, d16)[1] == (
        f"        folder changed: {world['ckpt']} was promoted as other weights ({other[:16]}), not {d16}: engines "
        f"on it will not use this arena; run: free the arena: preload-gate stop {d16}")
    assert a["folder"] == "changed"


def test_a_folder_recreated_with_other_weights_not_promoted_is_changed(world: dict, capsys) -> None:
    shutil.rmtree(world["ckpt"])
    fresh_checkpoint(world["ckpt"], seed=6, shards=1)
    lines, a = _status(world["root"], capsys)
    line = _arena_lines(lines, world["digest"][:16])[1]
    assert line.startswith(f"        folder changed: {world['ckpt']} changed since promotion (")
    # the promote into the cache the engines read (the rank line's rule: promote_command), not the default one
    from preload.identity.manifest import promote_command

    assert line.endswith(f"run: {promote_command(world['ckpt'])} (if it now holds other weights, free the arena: "
                         f"preload-gate stop {world['digest'][:16]})")
    assert "--cache-dir" in line
    assert a["folder"] == "changed"
