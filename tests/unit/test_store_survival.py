"""A daemon watches its fd store, and every read from disk says why (issue 39).

Real processes, the raw stage (no vLLM): a daemon on the tiny fixture, its
keeper, and a successor after a crash (every process of the first daemon
SIGKILLed). Each rule runs twice: as built, and as a control with the old
rule put back in the daemon's own processes (a ``sitecustomize`` on their
``PYTHONPATH`` that patches the one function; the product has no switch for it):

- the keeper killed -9 under a serving daemon: the daemon says so in one line
  naming what is at risk, starts a new keeper and re-deposits; after a crash
  the successor adopts (control, no watch: nothing is stored, the successor
  reads disk and says ``store_lost``);
- the socket root removed (``rm -rf``): the root is re-created with a new
  keeper holding the arena again; the successor adopts (control: it reads
  disk and says ``no_store``);
- an arena expired at its ``--orphan-ttl``: the successor says when, in its
  ready line and as a load event; its neighbour ``--orphan-ttl 0`` is adopted;
- a key that differs (config.json edited): the successor says which field;
- ``--take-over`` by a successor of another key is refused in one line, exit
  2, and the old daemon keeps serving (control, no key check: the old daemon
  hands over and exits and the successor reads disk).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import Daemon, process_gone, repo_pythonpath, short_dir, wait_for
from reliability_support import fresh_checkpoint, promote_checkpoint

from preload.client import DaemonClient
from preload.daemon.fdstore import FdStoreError, KeeperStore, open_store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

BOUND_S = 30.0

# The old rules, put back inside the daemon's processes for a control.
CONTROLS = {
    "no_store_watch": "from preload.daemon import store_watch\n"
                      "store_watch.StoreWatch.start = lambda self: None\n",
    "no_take_over_key_check": "from preload.daemon import take_over\n"
                              "take_over.same_key_or_refuse = lambda *a, **k: None\n",
}


@dataclasses.dataclass
class Setup:
    checkpoint: Path
    root: Path
    cache: Path
    digest: str
    tmp: Path
    control: str = ""

    def daemon(self, *extra: str) -> Daemon:
        env = {"PRELOAD_GATE_KEEPER_IDLE_S": "1", "PRELOAD_GATE_EVENTS": str(self.tmp / "events.jsonl")}
        if self.control:
            site = self.tmp / f"site-{self.control}"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(CONTROLS[self.control])
            env["PYTHONPATH"] = os.pathsep.join([repo_pythonpath(), str(site)])
        return Daemon(self.checkpoint, self.root, self.cache,
                      args=("--stage", "raw", "--expect-digest", self.digest, *extra), env=env)

    def events(self) -> list[dict]:
        path = self.tmp / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    root, cache = short_dir("pg-watch-"), tmp_path / "cache"
    cache.mkdir()
    ckpt = fresh_checkpoint(tmp_path / "m", seed=9, shards=1)
    yield Setup(ckpt, root, cache, promote_checkpoint(ckpt, root, cache), tmp_path)
    try:
        store = open_store(root, start=False)
    except FdStoreError:
        store = None
    if store is not None:
        assert isinstance(store, KeeperStore)
        pid = store.keeper_pid
        store.drop()
        store.close()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: process_gone(pid), BOUND_S)
    shutil.rmtree(root, ignore_errors=True)


def _keeper_pid(root: Path) -> int:
    store = KeeperStore(root, start=False)
    try:
        return store.keeper_pid
    finally:
        store.close()


def _stored(root: Path) -> list[dict]:
    try:
        store = open_store(root, start=False)
    except FdStoreError:
        return []
    if store is None:
        return []
    try:
        return store.list()
    finally:
        store.close()


def _held_by(root: Path, pid: int) -> bool:
    return any(a["held"] and a["pid"] == pid for a in _stored(root))


def _rank(d: Daemon) -> dict:
    return d.ready["ranks"][0]


def _successor(s: Setup, first: Daemon) -> dict:
    if first.proc is not None and first.proc.poll() is None:
        first.kill_hard()
    second = s.daemon().start()
    try:
        return {**_rank(second), "output": second._stderr()}
    finally:
        assert second.stop() == 0


@pytest.mark.parametrize("control", ["", "no_store_watch"], ids=["fixed", "control_old_rule"])
def test_a_killed_keeper_is_replaced_and_a_successor_adopts(setup: Setup, control: str) -> None:
    setup.control = control
    first = setup.daemon().start()
    assert _rank(first)["origin"] == "disk" and _held_by(setup.root, first.rank_pid)
    old = _keeper_pid(setup.root)
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: process_gone(old), BOUND_S)
    if control:
        time.sleep(3.0)  # three watch intervals: nobody replaces it
        assert _stored(setup.root) == []
        setup.control = ""  # the successor is today's daemon: it says why it reads disk
        rank = _successor(setup, first)
        assert rank["origin"] == "disk"
        assert rank["disk_reason"]["kind"] == "store_lost", rank["disk_reason"]
        assert "keeper.sock is there but no keeper answers" in rank["disk_reason"]["why"]
        assert any(e["mode"] == "adopt" and e["reason"].startswith("store_lost: ") for e in setup.events())
        return
    assert wait_for(lambda: _held_by(setup.root, first.rank_pid), BOUND_S)
    assert _keeper_pid(setup.root) != old
    log = first._stderr()
    assert (f"rank 0: the fd store under {setup.root} is gone (keeper pid {old}: killed, or its socket root "
            f"removed); at risk: {setup.digest[:16]} rank 0, ") in log, log[-3000:]
    assert "holds the arena again (re-deposited)" in log
    rank = _successor(setup, first)
    assert rank["origin"] == "adopted" and rank["generation"] == 1 and rank["disk_reason"] is None, rank


@pytest.mark.parametrize("control", ["", "no_store_watch"], ids=["fixed", "control_old_rule"])
def test_a_removed_socket_root_is_recreated_with_its_keeper(setup: Setup, control: str) -> None:
    setup.control = control
    first = setup.daemon().start()
    old = _keeper_pid(setup.root)
    subprocess.run(["rm", "-rf", str(setup.root)], check=True)
    assert wait_for(lambda: process_gone(old), BOUND_S)  # the keeper leaves once its socket is gone
    if control:
        time.sleep(3.0)
        assert _stored(setup.root) == []
        setup.control = ""
        rank = _successor(setup, first)
        assert rank["origin"] == "disk" and rank["disk_reason"]["kind"] == "no_store", rank["disk_reason"]
        return
    assert wait_for(lambda: _held_by(setup.root, first.rank_pid), BOUND_S)
    assert (setup.root.stat().st_mode & 0o777) == 0o700
    assert "holds the arena again (re-deposited)" in first._stderr()
    rank = _successor(setup, first)
    assert rank["origin"] == "adopted" and rank["disk_reason"] is None, rank


@pytest.mark.parametrize("ttl", ["1", "0"], ids=["expired", "neighbour_kept_until_stop"])
def test_an_expired_arena_is_said_with_when(setup: Setup, ttl: str) -> None:
    first = setup.daemon("--orphan-ttl", ttl).start()
    (stored,) = _stored(setup.root)
    first.kill_hard()
    if ttl == "0":
        time.sleep(2.0)
        rank = _successor(setup, first)
        assert rank["origin"] == "adopted", rank
        return
    assert wait_for(lambda: _stored(setup.root) == [], BOUND_S)
    rank = _successor(setup, first)
    reason = rank["disk_reason"]
    assert rank["origin"] == "disk" and reason["kind"] == "arena_expired", reason
    assert " expired at " in reason["why"] and "after its 1 s orphan TTL (--orphan-ttl)" in reason["why"]
    (event,) = [e for e in setup.events() if e["reason"].startswith("arena_expired: ")]
    assert event["mode"] == "adopt" and event["outcome"] == "miss" and event["source"] == "disk" and event["reason"].startswith("arena_expired: ")
    assert stored["orphan_ttl_s"] == 1.0


def _edit_config(ckpt: Path) -> None:
    p = ckpt / "config.json"
    cfg = json.loads(p.read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
    p.write_text(json.dumps(cfg))


def test_a_key_that_differs_is_said_with_its_fields(setup: Setup) -> None:
    first = setup.daemon().start()
    first.kill_hard()
    _edit_config(setup.checkpoint)
    second = setup.daemon().start()
    try:
        reason = _rank(second)["disk_reason"]
    finally:
        second.stop()
    assert reason["kind"] == "key_differs" and reason["fields"] == ["config_digest"], reason
    (event,) = [e for e in setup.events() if e["reason"].startswith("key_differs: ")]
    assert event["fields"] == ["config_digest"] and event["reason"].startswith("key_differs: ")


@pytest.mark.parametrize("control", ["", "no_take_over_key_check"], ids=["fixed", "control_old_rule"])
def test_take_over_by_another_key_is_refused_and_the_old_daemon_serves(setup: Setup, control: str) -> None:
    first = setup.daemon().start()
    try:
        _edit_config(setup.checkpoint)
        setup.control = control
        second = setup.daemon("--take-over").start(expect_ready=False)
        if control:  # the bug: the old daemon handed over and left; the successor read the disk
            try:
                assert wait_for(lambda: first.proc.poll() is not None, BOUND_S)
                assert _rank(second)["origin"] == "disk"
                assert _rank(second)["disk_reason"]["kind"] == "key_differs"
            finally:
                second.stop()
            return
        assert second.proc.returncode == 2
        lines = [x for x in second.output.splitlines() if "error:" in x]
        assert len(lines) == 1, second.output[-3000:]
        assert "--take-over refused: this daemon's key differs from the running one's" in lines[0]
        assert f"(pid {first.rank_pid}) in config_digest (running " in lines[0]
        assert "the old daemon keeps serving" in lines[0]
        # It does: same process, answering, its arena still held in the store.
        assert first.proc.poll() is None
        c = DaemonClient.connect(first.socket_dir, 0, client="test")
        try:
            assert c.stats()["pid"] == first.rank_pid
        finally:
            c.close()
        assert _held_by(setup.root, first.rank_pid)
    finally:
        if first.proc.poll() is None:
            first.stop()
