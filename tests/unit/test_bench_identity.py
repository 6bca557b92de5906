"""Identity benchmarks: they run, they measure with the shim, and the
properties that are behaviour (not timing) hold: content/stat opens no shard,
content/pinned touches nothing. No timing is asserted here; figures are
ratios in the bench output."""

from __future__ import annotations

import json

import pytest

from harness.bench import BenchError, BenchOptions, load_rows, markdown, parse_size, run_rows
from harness.bench.identity import write_synthetic
from harness.bench.remote_fs import RemoteFS
from preload.identity import anchors
from preload.identity.manifest import StaleManifestError
from preload.promote import promote
from preload_gate.cli import main

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_vllm")]


@pytest.fixture(autouse=True)
def _pool_backend(monkeypatch):
    """The shim sees only stats issued from Python: the thread pool's."""
    from preload.identity.filestat import STAT_BACKEND_ENV

    monkeypatch.setenv(STAT_BACKEND_ENV, "pool")


@pytest.fixture
def many_shards(tmp_path):
    ckpt = tmp_path / "ckpt"
    paths = write_synthetic(ckpt, shards=12, shard_bytes=64 << 10)
    cache = tmp_path / "cache"
    digest = promote(ckpt, socket_root=tmp_path / "s", cache_dir=cache, progress=False).digest
    return ckpt, cache, digest, paths


def _counts(ckpt, fn):
    with RemoteFS([ckpt]) as fs:
        fn()
    return fs.counts


def test_content_stat_opens_no_shard(many_shards):
    ckpt, cache, digest, paths = many_shards
    c = _counts(ckpt, lambda: anchors.content(ckpt, "stat", cache_dir=cache))
    assert c.opens == 0 and c.reads == 0
    assert c.stats >= len(paths)


def test_content_pinned_touches_nothing(many_shards):
    ckpt, cache, digest, _ = many_shards
    c = _counts(ckpt, lambda: anchors.content(ckpt, "pinned", expected_digest=digest))
    assert c.touched == 0


def test_the_shim_sees_the_anchors_io(many_shards):
    """Control: the zero counts above are not the shim being blind."""
    ckpt, cache, _, paths = many_shards
    assert _counts(ckpt, lambda: anchors.header_only(ckpt, "reimpl")).opens >= len(paths)
    sampled = _counts(ckpt, lambda: anchors.sampled_1k(ckpt))
    assert sampled.opens >= len(paths) and sampled.reads >= 4 * len(paths)
    full = _counts(ckpt, lambda: anchors.content(ckpt, "full"))
    assert full.bytes_read >= sum(p.stat().st_size for p in paths)
    # A stale manifest (a shard touched) is refused by name in stat mode, with stats only.
    paths[0].touch()

    def stale() -> None:
        with pytest.raises(StaleManifestError, match=paths[0].name):
            anchors.content(ckpt, "stat", cache_dir=cache)

    counts = _counts(ckpt, stale)
    assert counts.opens == 0 and counts.stats >= len(paths)


def test_shim_charges_latency_per_access(many_shards):
    import time

    ckpt, _, _, paths = many_shards
    with RemoteFS([ckpt], latency_s=0.01, stat_latency_s=0.0) as fs:
        t0 = time.perf_counter()
        anchors.header_only(ckpt, "reimpl")
        wall = time.perf_counter() - t0
    assert wall >= 0.01 * (fs.counts.opens + fs.counts.reads)


def test_restart_row_runs_small(tmp_path):
    opts = BenchOptions(workdir=tmp_path, params={"shards": "5", "shard_mb": "0.1", "latency_ms": "0",
                                                       "header_impl": "reimpl"})
    results = run_rows(opts, ["restart_identity"])
    table = {r["scheme"]: r for r in results[0].details["table"]}
    assert set(table) == {"header_only", "sampled_1k", "path_stat", "realpath",
                          "content/stat", "content/pinned", "content/full"}
    assert table["content/stat"]["opens"] == 0
    assert table["content/pinned"]["opens"] + table["content/pinned"]["stats"] == 0
    assert table["header_only"]["opens"] >= 5
    md = markdown(results)
    assert "header_only" in md and "content/stat" in md
    assert not list(tmp_path.iterdir()), "scratch checkpoints are removed"
    assert len(results) == 4, "latency_ms=0 is the local variant alone"


def test_restart_row_measures_with_and_without_latency(tmp_path):
    """One run, both variants side by side, same files; the zero-I/O properties hold in each."""
    opts = BenchOptions(workdir=tmp_path, params={"shards": "4", "shard_mb": "0.05", "latency_ms": "2",
                                                       "header_impl": "reimpl", "trip_shards": "6,4",
                                                       "trip_repeats": "2"})
    results = run_rows(opts, ["restart_identity"])
    # 4 pairs per variant, and content/stat in round trips for the remote one at 4 and 6 shards
    assert len(results) == 10
    rows = results[0].details["table"]
    assert [r["latency_ms"] for r in rows] == [2.0] * 7 + [0.0] * 7
    for latency in (2.0, 0.0):
        t = {r["scheme"]: r for r in rows if r["latency_ms"] == latency}
        assert t["content/stat"]["opens"] == 0 and t["content/stat"]["stats"] >= 4
        assert t["content/pinned"]["opens"] + t["content/pinned"]["stats"] + t["content/pinned"]["reads"] == 0
        assert t["header_only"]["opens"] >= 4, "control: the anchor's opens are counted in both variants"
        if latency:  # the shim charged the remote variant per access (a lower bound, not a timing claim)
            h = t["header_only"]
            assert h["wall_s"] >= 0.002 * (h["opens"] + h["reads"])
    titles = [r.title for r in results]
    assert sum("2 ms remote fs" in t for t in titles) == 6 and sum("local fs (0 ms)" in t for t in titles) == 4
    trips = [r for r in results if "round trips" in r.title]
    assert [r.details["trip_shards"] for r in trips] == [4, 6]
    for r, n in zip(trips, (4, 6), strict=True):
        assert r.anchor.value == 0.002 and r.ratio == r.details["wall_s"] / 0.002
        # One stat per shard plus the directory and the index, none opened; the
        # shim charged each round trip at least once (a lower bound, not a timing claim).
        assert r.details["stats"] == n + 2 and r.details["opens"] == 0
        assert len(r.details["cold_walls_s"]) == len(r.details["prestarted_walls_s"]) == 2
        assert len(r.details["cold_cpu_s"]) == len(r.details["prestarted_cpu_s"]) == 2
        assert min(r.details["cold_walls_s"] + r.details["prestarted_walls_s"]) >= 0.002
        assert "cold (no PRELOAD_GATE_STAT_WORKERS" in r.notes and "pool prestarted: " in r.notes
        assert r.details["cold_round_trips"] == r.details["cold_wall_s"] / 0.002
        judged = "io_uring" if r.details["backend"] == "uring" else "pool prestarted"
        assert judged in r.ours.label and r.details["fs"] in r.ours.label.replace("FUSE mirror", "fuse")
        if r.details["fs"] == "fuse":  # the kernel's FUSE client saw one GETATTR per stat, whoever issued it
            assert r.details["fuse_counts"].get("GETATTR") == n + 2 and "OPEN" not in r.details["fuse_counts"]
            if r.details["backend"] == "uring":
                assert len(r.details["uring_walls_s"]) == 2 and "io_uring (fresh ring each)" in r.notes
                assert r.details["wall_s"] == pytest.approx(sum(r.details["uring_walls_s"]) / 2, abs=1e-6)
    # The remote pairs take ours from the median of RemoteFS cold starts (pool forced); the local ones from the table.
    remote = [r for r in results if "2 ms remote fs (" in r.title and "content/stat" in r.ours.label]
    local = [r for r in results if "local fs (0 ms) (" in r.title and "content/stat" in r.ours.label]
    assert len(remote) == len(local) == 3
    for r in remote:
        assert r.ours.value == r.details["cold_wall_s"] and len(r.details["cold_walls_s"]) == 2
        assert "median of 2 cold starts" in r.notes and "thread pool's" in r.notes
    local_wall = {r["scheme"]: r["wall_s"] for r in rows if r["latency_ms"] == 0.0}["content/stat"]
    assert all(r.ours.value == pytest.approx(local_wall, abs=1e-6) and "cold starts" not in r.notes for r in local)
    from preload.identity import uring

    if uring.unavailable() is None:  # on local disk io_uring's wall is given beside the pool's (no shim there)
        assert all(len(r.details["uring_walls_s"]) == 2 and "through io_uring" in r.notes for r in local)
    pinned = [r for r in results if r.ours.label.startswith("content/pinned")]
    assert len(pinned) == 2 and all(r.ratio is None for r in pinned)


def test_without_fuse_the_round_trips_are_remote_fs_with_the_reason(tmp_path, monkeypatch):
    """Not root, no /dev/fuse: the round-trip rows still run (RemoteFS, the pool) and say why."""
    from harness.bench import fuse_fs

    def refuse(self):
        raise fuse_fs.FuseUnavailableError("not root: mounting FUSE without fusermount needs CAP_SYS_ADMIN")

    monkeypatch.setattr(fuse_fs.FuseFS, "__enter__", refuse)
    opts = BenchOptions(workdir=tmp_path, params={"shards": "3", "shard_mb": "0.05", "latency_ms": "2",
                                                       "header_impl": "reimpl", "trip_shards": "5",
                                                       "trip_repeats": "1", "schemes": "content/stat"})
    trips = [r for r in run_rows(opts, ["restart_identity"]) if "round trips" in r.title]
    assert [r.details["trip_shards"] for r in trips] == [3, 5]
    for r, n in zip(trips, (3, 5), strict=True):
        assert r.details["fs"] == "remote_fs" and r.details["backend"] == "pool"
        assert r.details["stats"] == n + 2, "RemoteFS counted every stat: the pool issued them"
        assert "FUSE rows not run: not root" in r.notes and "pool prestarted, RemoteFS" in r.ours.label


def test_restart_row_bad_latency(tmp_path):
    with pytest.raises(BenchError, match="latency"):
        run_rows(BenchOptions(workdir=tmp_path, params={"latency_ms": "-1"}), ["restart_identity"])
    for bad in ({"trip_shards": "many"}, {"trip_shards": "0"}, {"trip_repeats": "0"}):
        with pytest.raises(BenchError, match="trip_"):
            run_rows(BenchOptions(workdir=tmp_path, params=bad), ["restart_identity"])
    assert not list(tmp_path.iterdir()), "refused before writing a checkpoint"


def test_throughput_row_runs_small(tmp_path):
    opts = BenchOptions(workdir=tmp_path, size_bytes=4 << 20, params={"repeats": "1", "hash_shards": "4"})
    (r,) = run_rows(opts, ["promote_throughput"])
    assert r.ratio is not None and r.ratio > 0
    assert r.details["bytes"] >= 4 << 20


def test_bench_verb_writes_json_and_markdown(tmp_path, capsys):
    rc = main(["bench", "--only", "restart_identity", "--json", "--out", str(tmp_path / "out"),
               "--workdir", str(tmp_path / "w"), "--param", "shards=3", "--param", "shard_mb=0.05",
               "--param", "latency_ms=0", "--param", "header_impl=reimpl"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["row"] == "restart_identity"
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == doc
    assert (tmp_path / "out" / "bench.md").read_text().startswith("| row |")
    page = (tmp_path / "out" / "bench.html").read_text()
    assert page.count("<svg") == len(doc["results"]) and "restart identity" in page


def test_bench_bad_input(capsys):
    assert main(["bench", "--only", "nope"]) == 2
    assert "unknown benchmark rows" in capsys.readouterr().err
    assert main(["bench", "--param", "oops"]) == 2
    with pytest.raises(BenchError):
        parse_size("lots")


def test_parse_size():
    assert parse_size("2G") == 2 << 30 and parse_size("64M") == 64 << 20
    assert parse_size("512KiB") == 512 << 10 and parse_size("100") == 100


def test_registry_has_the_identity_rows():
    assert {"restart_identity", "promote_throughput"} <= set(load_rows())


def _stats_sleep_together(fs_cls, root, monkeypatch) -> bool:
    """Whether 8 concurrent stats under ``fs_cls`` are all in their latency
    wait at once (a barrier stands in for the shim's sleep)."""
    import os
    import threading

    import harness.bench.remote_fs as remote_fs

    barrier = threading.Barrier(8, timeout=2)

    class Clock:
        @staticmethod
        def sleep(_s: float) -> None:
            barrier.wait()

    monkeypatch.setattr(remote_fs, "time", Clock)
    broken = []

    def one() -> None:
        try:
            os.stat(root)
        except threading.BrokenBarrierError:
            broken.append(1)

    with fs_cls([root], latency_s=0.05):
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return not broken


def test_shim_overlaps_concurrent_stats(tmp_path, monkeypatch):
    """A remote FS serves concurrent stats concurrently: the shim's lock covers
    its counters, never the latency. Control: a shim that sleeps under its
    lock serializes them, and the same check fails."""

    import harness.bench.remote_fs as remote_fs

    class Serializing(RemoteFS):
        def _charge(self, kind: str, nbytes: int = 0) -> None:
            with self._lock:  # the latency charged under the lock
                remote_fs.time.sleep(self.stat_latency_s)

    assert _stats_sleep_together(RemoteFS, tmp_path, monkeypatch)
    assert not _stats_sleep_together(Serializing, tmp_path, monkeypatch)
