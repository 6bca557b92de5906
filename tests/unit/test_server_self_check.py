"""A rank checks the key it serves against its own wire parser before its
socket exists, so a key that no engine's request could match is refused at
start, by name, instead of answering every get_state with "bad key".

The control serves the key the stage built and shows an engine attaching.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_support import fresh_checkpoint, short_tempdir

from pgbase.errors import PreloadGateError
from preload.client import DaemonClient
from preload.daemon.lock import RankLock
from preload.daemon.raw import fill_raw
from preload.daemon.server import RankServer
from preload.daemon.stage import Filled
from preload.transports import get_transport

pytestmark = pytest.mark.unit


@pytest.fixture()
def filled(tmp_path: Path) -> Iterator[Filled]:
    f = fill_raw(fresh_checkpoint(tmp_path / "ckpt", seed=5), get_transport("shm"), None)
    yield f
    f.arena.close()


@pytest.fixture()
def sdir() -> Iterator[Path]:
    root = short_tempdir("pg-selfck-")
    d = root / "d"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(root, ignore_errors=True)


def test_a_key_our_parser_refuses_stops_the_rank_before_it_binds(filled: Filled, sdir: Path) -> None:
    # A str where the key declares an int: what a stage that built its key
    # from an unparsed config value would serve.
    bad = dataclasses.replace(filled, key=dataclasses.replace(filled.key, tp_size="1"))  # type: ignore[arg-type]
    lock = RankLock.acquire(sdir, 0)
    server = RankServer(bad, sdir, 0, lock)
    try:
        with pytest.raises(PreloadGateError, match=r"rank 0: the key we serve fails our own wire parser .*tp_size"):
            server.start()
        assert not server.path.exists()
    finally:
        lock.release()


def test_control_the_stage_key_serves_and_an_engine_attaches(filled: Filled, sdir: Path) -> None:
    server = RankServer(filled, sdir, 0, RankLock.acquire(sdir, 0))
    server.start()
    try:
        client = DaemonClient.connect(sdir, 0, client="test")
        try:
            att = client.get_state(filled.key).attach()
            assert set(att.tensors) == {e.name for e in filled.layout.entries}
            att.close()
        finally:
            client.close()
    finally:
        server.stop()
