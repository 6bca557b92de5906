"""Weights that outlive their daemon (issue 26), CPU: the keeper and re-adoption.

A raw shm daemon on the tiny fixture, every process of it SIGKILLed; a
successor started with the same arguments re-adopts the sealed memfd the
keeper held, proven by its seals, reading no checkpoint byte, and serves
bytes equal to ``safe_open``'s. Each rule has its control:

- a store record whose memfd lacks the write seal (a forged deposit with a
  valid record): the proof fails, loudly, naming the rank; the successor
  reads from disk and serves correct bytes;
- a stored arena of another stage (another key): not adopted, read from disk,
  no proof failure;
- ``--no-fd-store``: nothing kept, the successor reads from disk;
- a clean stop (SIGTERM) leaves the store empty.

No vLLM engine: the raw stage and the engine-side client are enough here.
Only the raw stage adopts (its key is known before the fill; the loaded and
processed stages' keys come from vLLM's config built in the rank's world,
see preload.daemon.adopt.expected_key), and vLLM engines attach only those
stages, so an engine attaching to an adopted daemon has no test yet.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from daemon_support import Daemon, process_gone, short_dir, wait_for
from reliability_support import (
    attach_raw,
    checkpoint_tensor_digests,
    promote_checkpoint,
    tensor_digests,
)

from preload.client import DaemonClient
from preload.daemon import keeper
from preload.daemon.fdstore import KeeperStore, open_store
from preload.transports.shm import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK

pytestmark = [pytest.mark.cpu, pytest.mark.timeout(300)]

BOUND_S = 30.0


@dataclasses.dataclass
class Setup:
    checkpoint: Path
    root: Path
    cache: Path
    digest: str

    def daemon(self, *extra: str) -> Daemon:
        return Daemon(
            self.checkpoint,
            self.root,
            self.cache,
            args=("--stage", "raw", "--expect-digest", self.digest, *extra),
            env={"PRELOAD_GATE_KEEPER_IDLE_S": "1"},
        )


@pytest.fixture
def setup(tiny_ckpt: Path, tmp_path: Path) -> Iterator[Setup]:
    root, cache = short_dir("pg-surv-"), tmp_path / "cache"
    cache.mkdir()
    digest = promote_checkpoint(tiny_ckpt, root, cache)
    yield Setup(tiny_ckpt, root, cache, digest)
    store = open_store(root, start=False)
    if store is not None:  # what a failed test left: drop it, the keeper exits idle
        assert isinstance(store, KeeperStore)
        pid = store.keeper_pid
        store.drop()
        store.close()
        wait_for(lambda: process_gone(pid), BOUND_S)
    shutil.rmtree(root, ignore_errors=True)


class _Served:
    """What a daemon's rank 0 serves: its ready line, its stats, its tensors' digests
    (attached through the engine-side client, as an engine does)."""

    def __init__(self, d: Daemon, s: Setup) -> None:
        self.rank = d.ready["ranks"][0]
        c = DaemonClient.connect(d.socket_dir, 0, client="test-survival")
        try:
            self.stats = c.stats()
        finally:
            c.close()
        att, tensors = attach_raw(d.socket_dir, s.checkpoint, s.digest)
        try:
            self.tensors = tensor_digests(tensors)
        finally:
            att.close()  # type: ignore[attr-defined]


def _stored(s: Setup) -> list[dict]:
    store = open_store(s.root, start=False)
    if store is None:
        return []
    try:
        return store.list()
    finally:
        store.close()


def test_a_successor_adopts_after_kill_9_and_a_clean_stop_empties_the_store(setup: Setup) -> None:
    want = checkpoint_tensor_digests(setup.checkpoint)
    first = setup.daemon().start()
    served = _Served(first, setup)
    # Control: the first daemon read the checkpoint.
    assert served.rank["origin"] == "disk" and served.rank["bytes_read"] > 0, served.rank
    assert served.rank["fd_store"] == "keeper"
    assert served.stats["loaded_from_disk"] == 1 and served.stats["adopted"] == 0
    assert served.tensors == want
    first.kill_hard()  # every process of it: the launcher and its rank
    (stored,) = _stored(setup)
    assert (
        stored["held"] is False and stored["origin"] == "disk" and stored["pid"] == first.rank_pid
    )

    second = setup.daemon().start()
    try:
        served = _Served(second, setup)
        assert served.rank["origin"] == "adopted", (served.rank, second.output)
        assert served.rank["bytes_read"] == 0 and served.rank["load_seconds"] == 0
        assert served.rank["generation"] == 1 and served.rank["adopt_seconds"] >= 0
        assert served.stats["adopted"] == 1 and served.stats["loaded_from_disk"] == 0
        assert served.tensors == want
        (stored,) = _stored(setup)
        assert (
            stored["held"] is True and stored["origin"] == "adopted" and stored["generation"] == 1
        )
    finally:
        assert second.stop() == 0
    # A clean stop takes the arena out of the store.
    assert _stored(setup) == []


def _forge(s: Setup, *, seal_write: bool, change_stage: bool = False) -> KeeperStore:
    """Replace the stored arena by a copy of its bytes in a new memfd (sealed
    but for the write seal, when ``seal_write`` is False), under the same
    record (or one of another stage); returns the depositing handle."""
    store = open_store(s.root, start=False)
    assert isinstance(store, KeeperStore)
    got = store.fetch(s.digest, 0)
    assert got is not None
    (src,) = got.fds
    size = os.fstat(src).st_size
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.write(fd, os.pread(src, size, 0))
    os.close(src)
    fcntl.fcntl(
        fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | (0 if not seal_write else 0x8) | F_SEAL_SEAL
    )
    record = got.record
    if change_stage:
        record = msgspec.structs.replace(
            record, stage="loaded", key={**record.key, "export_stage": "loaded"}
        )
    store.deposit(record, [fd])
    os.close(fd)
    return store


def test_an_unsealed_forged_memfd_fails_its_proof_and_the_successor_reads_disk(
    setup: Setup,
) -> None:
    want = checkpoint_tensor_digests(setup.checkpoint)
    setup.daemon().start().kill_hard()
    forger = _forge(setup, seal_write=False)
    second = setup.daemon().start()
    try:
        served = _Served(second, setup)
    finally:
        second.stop()
        forger.close()
    assert served.rank["origin"] == "disk" and served.rank["bytes_read"] > 0, served.rank
    # Its ready line says why (issue 39); the error event below is the only event.
    assert served.rank["disk_reason"]["kind"] == "proof_failed", served.rank["disk_reason"]
    assert served.stats["proof_failed"] == 1 and served.stats["adopted"] == 0
    assert served.tensors == want
    events = [
        ln for ln in second.output.splitlines() if "preload-gate load:" in ln and '"adopt"' in ln
    ]
    assert len(events) == 1, second.output[-3000:]
    assert "rank 0" in events[0] and "lacks seals ['write']" in events[0], events[0]


def test_a_write_sealed_copy_is_adopted(setup: Setup) -> None:
    """Control of the forgery above: the same copy with its write seal proves and is adopted."""
    setup.daemon().start().kill_hard()
    forger = _forge(setup, seal_write=True)
    second = setup.daemon().start()
    try:
        served = _Served(second, setup)
    finally:
        second.stop()
        forger.close()
    assert served.rank["origin"] == "adopted" and served.stats["proof_failed"] == 0
    assert served.tensors == checkpoint_tensor_digests(setup.checkpoint)


def test_a_stored_arena_of_another_stage_is_not_adopted(setup: Setup) -> None:
    setup.daemon().start().kill_hard()
    forger = _forge(setup, seal_write=True, change_stage=True)
    second = setup.daemon().start()
    try:
        served = _Served(second, setup)
    finally:
        second.stop()
        forger.close()
    assert served.rank["origin"] == "disk" and served.rank["bytes_read"] > 0
    assert served.rank["disk_reason"]["kind"] == "stage_differs", served.rank["disk_reason"]
    assert served.stats["adopted"] == 0 and served.stats["proof_failed"] == 0
    assert "not adopting the stored arena: the stored arena is stage loaded" in second.output
    assert served.tensors == checkpoint_tensor_digests(setup.checkpoint)


def test_no_fd_store_keeps_nothing(setup: Setup) -> None:
    first = setup.daemon("--no-fd-store").start()
    assert first.ready["ranks"][0]["fd_store"] is None
    first.kill_hard()
    assert not keeper.socket_file(setup.root).exists() and _stored(setup) == []
    second = setup.daemon().start()
    try:
        assert (
            second.ready["ranks"][0]["origin"] == "disk"
            and second.ready["ranks"][0]["bytes_read"] > 0
        )
    finally:
        second.stop()


def test_take_over_hands_the_arena_to_a_successor_and_attached_mappings_stay(setup: Setup) -> None:
    want = checkpoint_tensor_digests(setup.checkpoint)
    first = setup.daemon().start()
    att, tensors = attach_raw(first.socket_dir, setup.checkpoint, setup.digest)
    try:
        assert tensor_digests(tensors) == want
        second = setup.daemon("--take-over").start()
        try:
            rank = second.ready["ranks"][0]
            assert rank["origin"] == "adopted" and rank["bytes_read"] == 0, (rank, second.output)
            assert rank["took_over_from"]["pid"] == first.rank_pid, rank
            assert rank["generation"] == 1
            # The old daemon is gone (it exited without release) ...
            wait_for(lambda: process_gone(first.rank_pid), BOUND_S)
            # Its launcher ends without error once its rank handed over (rc 0, said so).
            assert first.proc is not None and first.proc.wait(BOUND_S) == 0
            first.output = first._stderr()  # type: ignore[attr-defined]
            assert "handed its arena over to a successor" in first.output, first.output[-3000:]
            # ... the engine attached to it still maps the same bytes ...
            assert tensor_digests(tensors) == want
            # ... and the successor serves them, from the arena the old one stored,
            # its stats (what status reads) naming the predecessor.
            served = _Served(second, setup)
            assert served.tensors == want
            assert served.stats["took_over_from"]["pid"] == first.rank_pid
            assert served.stats["origin"] == "adopted" and served.stats["generation"] == 1
            (stored,) = _stored(setup)
            assert stored["held"] is True and stored["generation"] == 1
            assert stored["pid"] == second.rank_pid
        finally:
            assert second.stop() == 0
    finally:
        att.close()  # type: ignore[attr-defined]
        first.stop()
    assert _stored(setup) == []


def test_take_over_of_a_daemon_without_the_fd_store_is_refused_and_it_keeps_serving(
    setup: Setup,
) -> None:
    """Control of the take-over: a daemon that stored nothing cannot hand
    over; the successor says so and exits, the first one keeps serving."""
    first = setup.daemon("--no-fd-store").start()
    try:
        second = setup.daemon("--take-over").start(expect_ready=False)
        assert second.proc is not None and second.proc.returncode not in (0, None)
        assert "--take-over refused" in second.output, second.output[-3000:]
        assert "keeps no arena in the fd store" in second.output, second.output[-3000:]
        assert first.proc is not None and first.proc.poll() is None
        served = _Served(first, setup)
        assert served.tensors == checkpoint_tensor_digests(setup.checkpoint)
        assert served.stats["took_over_from"] is None and served.stats["origin"] == "disk"
    finally:
        assert first.stop() == 0
