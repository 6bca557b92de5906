"""Load: 32 engines attaching to one raw-stage daemon at once (CPU shm).

Every client must receive the right tensors, checked by digest against the
checkpoint's own bytes, while all 32 hold their mappings and watches at the
same time. Latency percentiles are a benchmark figure (``preload-gate bench
--only attach_load``), not asserted here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reliability_support import (
    RawDaemon,
    checkpoint_tensor_digests,
    fresh_checkpoint,
    promoted_daemon,
    tensor_digests,
)

from harness.bench.load import ClientResult, attach_many, concurrently, percentiles
from preload.client import Watch

pytestmark = [pytest.mark.unit, pytest.mark.xdist_group(name="reliability_load")]

CLIENTS = 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawDaemon]:
    base = tmp_path_factory.mktemp("load")
    with promoted_daemon(fresh_checkpoint(base / "ckpt", seed=9, shards=3), base / "cache") as d:
        yield d


def test_32_clients_attach_at_once(daemon: RawDaemon) -> None:
    expected = checkpoint_tensor_digests(daemon.checkpoint)
    results, attachments = attach_many(daemon.socket_dir, daemon.checkpoint, daemon.digest, CLIENTS)
    try:
        errors = [r.error for r in results if r.error]
        assert errors == [], errors
        assert len(results) == CLIENTS
        for i, r in enumerate(results):
            assert tensor_digests(r.tensors) == expected, f"client {i} got other tensors"
        assert daemon.stats()["hits"] >= CLIENTS
    finally:
        for a in attachments:
            a.close()


def test_32_watchers_are_all_counted(daemon: RawDaemon) -> None:
    """32 engines holding watches at once: the daemon counts every one, and
    every one is let go when they close."""
    watches: list[Watch] = []

    def watch(_i: int) -> ClientResult:
        w = Watch.open(daemon.socket_dir, 0, on_loss=lambda: None)
        watches.append(w)
        return ClientResult(0.0, {})

    try:
        results = concurrently(CLIENTS, watch)
        assert [r.error for r in results if r.error] == []
        assert daemon.stats()["attached"] == CLIENTS
    finally:
        for w in watches:
            w.close()
    import time

    end = time.monotonic() + 5
    while daemon.stats()["attached"] and time.monotonic() < end:
        time.sleep(0.05)
    assert daemon.stats()["attached"] == 0


def test_digest_check_catches_wrong_tensors(daemon: RawDaemon) -> None:
    """Control: the per-client digest comparison fails on one changed byte."""
    results, attachments = attach_many(daemon.socket_dir, daemon.checkpoint, daemon.digest, 1)
    try:
        got = dict(results[0].tensors)
        name = next(iter(got))
        t = got[name].clone()  # MAP_PRIVATE views are writable; clone anyway
        t.view(-1)[0] += 1
        got[name] = t
        assert tensor_digests(got) != checkpoint_tensor_digests(daemon.checkpoint)
    finally:
        for a in attachments:
            a.close()


def test_percentiles_nearest_rank() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert p == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
