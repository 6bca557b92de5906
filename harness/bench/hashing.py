"""Promotion hashing benchmark: ``preload.identity.digest.hash_shards``
against sequential ``sha256sum`` (coreutils, one process over all shards) on
the same multi-shard checkpoint, page cache warmed first, alternating runs."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from harness.bench import (
    BenchError,
    BenchOptions,
    BenchResult,
    Figure,
    bench_row,
    progress,
    scratch,
)
from harness.bench import params as P
from harness.bench.synthetic import write_synthetic
from preload.identity.digest import checkpoint_digest, hash_shards


def _sha256sum(paths: list[Path]) -> tuple[dict[str, str], float]:
    exe = shutil.which("sha256sum")
    if exe is None:
        raise BenchError("sha256sum (coreutils) is not on PATH")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [exe, *[p.name for p in paths]], cwd=paths[0].parent, capture_output=True, text=True,
        env={**os.environ, "LC_ALL": "C"}, check=True,
    )
    wall = time.perf_counter() - t0
    digests = {}
    for line in proc.stdout.splitlines():
        hex_, name = line.split("  ", 1)
        digests[name] = hex_
    return digests, wall


def _warm(paths: list[Path]) -> None:
    buf = bytearray(8 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


@bench_row("promote_throughput", "promotion hashing vs sequential sha256sum (page cache warm)",
           heavy="writes and hashes --size bytes (2 GiB by default) three times",
           params=(P.Param("hash_shards", P.integer(1, 10_000), 8),
                   P.Param("repeats", P.integer(1, 100), 3),
                   P.Param("workers", P.integer(0, 1024, "0: as many as promote uses"), 0)))
def promote_throughput(options: BenchOptions) -> list[BenchResult]:
    size = options.size_bytes
    shards = options.value("hash_shards")
    repeats = options.value("repeats")
    workers = options.value("workers") or None
    work = scratch(options, "pg-bench-hash-")
    try:
        paths = write_synthetic(work / "ckpt", shards, size // shards, tensors_per_shard=2)
        total = sum(p.stat().st_size for p in paths)
        load_before = os.getloadavg()
        progress(f"promote_throughput: warming {total / (1 << 30):.2f} GiB of page cache")
        _warm(paths)
        _warm(paths)
        coreutils, ours, ours_seq = [], [], []
        for _ in range(repeats):
            ref, t = _sha256sum(paths)
            coreutils.append(t)
            t0 = time.perf_counter()
            got = hash_shards(paths, workers=workers, progress=False)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hash_shards(paths, workers=1, progress=False)
            ours_seq.append(time.perf_counter() - t0)
            if got != ref:
                raise BenchError("hash_shards and sha256sum disagree; the benchmark is void")
        digest = checkpoint_digest(got)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c, o, s = statistics.median(coreutils), statistics.median(ours), statistics.median(ours_seq)
    gib = total / (1 << 30)
    return [
        BenchResult(
            row="promote_throughput",
            title=f"promotion hashing, {gib:.2f} GiB in {shards} shards",
            anchor=Figure("sequential sha256sum", gib / c, "GiB/s"),
            ours=Figure(f"hash_shards ({workers or os.cpu_count()} threads)", gib / o, "GiB/s"),
            ratio=c / o,
            ratio_meaning="sha256sum wall / ours wall",
            target=">= 1.7x on 2 cores",
            details={
                "bytes": total,
                "shards": shards,
                "repeats": repeats,
                "sha256sum_s": coreutils,
                "hash_shards_s": ours,
                "hash_shards_1_thread_s": ours_seq,
                "one_thread_ratio": c / s,
                "thread_speedup": s / o,
                "cpu_count": os.cpu_count(),
                # A shared machine: other load skews the threaded figure most.
                "loadavg_1m_before_after": [load_before[0], load_after[0]],
                "digest": digest,
            },
            notes=(
                f"median of {repeats}; of the {c / o:.2f}x, {c / s:.2f}x is one OpenSSL thread vs "
                f"coreutils, {s / o:.2f}x is threading"
            ),
        )
    ]
