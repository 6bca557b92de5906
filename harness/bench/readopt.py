"""Benchmark rows ``daemon_readopt`` (CPU, shm) and ``gpu_readopt`` (CUDA): a
daemon restart that re-adopts its arena from the fd store vs one that loads it.

The checkpoint (synthetic, ``--size`` bytes, page cache warm: it was just
written) is promoted first (``preload-gate promote``), so a starting daemon
knows its digest before it reads a byte (the manifest) and can look the
digest up in the socket root's fd store (:mod:`preload.daemon.fdstore`). A
daemon (``preload-gate preload --stage raw --transport T``) loads it, reading
and hashing every byte, and deposits its arena; its processes are then killed
with SIGKILL (a crash, not a stop: nothing is released). A successor started
with the same arguments takes the arena over from the store and proves it
(shm: the memfd's seals and size; cuda: every resident checksum recomputed
over the adopted bytes) before it serves. The row compares what each start
spent on its weights: ``load_seconds`` of the first (read, hash, place)
against ``adopt_seconds`` of the successor (fetch, import, map, prove), from
the ranks' own ready lines, and gives the wall time from start to ready of
both beside them (interpreter and torch start included, the same for both).
``preload-gate stop`` then stops the successor and drops the arena.

Where the successor did not re-adopt (it loaded from disk) the row says so
and claims nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.bench import BenchOptions, BenchResult, Figure, bench_row, not_run, scratch
from harness.bench import params as P
from harness.bench.gpu import GPU_PARAMS
from preload.daemon.ready import READY, NotReadyError, start_preload, wait_ready

TITLE = "daemon restart to ready: re-adopt the arena (including the proof) vs load it from disk"


def _start(ckpt: Path, root: Path, transport: str,
           env: dict[str, str]) -> tuple[subprocess.Popen[bytes], dict[str, Any], float]:
    t0 = time.perf_counter()
    proc = start_preload([str(ckpt), "--stage", "raw", "--transport", transport,
                          "--socket-root", str(root)], env=env, new_session=True)
    try:
        ready = wait_ready(proc, READY, timeout_s=None)
    except NotReadyError as exc:
        raise RuntimeError(f"daemon exited with {exc.returncode} before it was ready") from None
    return proc, ready, time.perf_counter() - t0


def _kill9(proc: subprocess.Popen[bytes], ready: dict[str, Any]) -> None:
    """SIGKILL the launcher's whole group and every rank: a crash, not a stop."""
    for r in ready.get("ranks", []):
        try:
            os.kill(int(r["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)


def _evict(root: Path, digest: str, env: dict[str, str]) -> None:
    """Stop what still runs and drop what the store still holds (it would keep the arena's memory)."""
    subprocess.run([*_cli(), "stop", "--socket-root", str(root), digest], capture_output=True, timeout=120,
                   env=env)


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "preload_gate"]


@bench_row("daemon_readopt", TITLE + " (CPU, sealed memfd)", heavy="two daemon starts on --size bytes",
           params=(P.Param("tensors", P.integer(1, 100_000), 160),))
def daemon_readopt(options: BenchOptions) -> list[BenchResult]:
    return _readopt(options, "daemon_readopt", "shm")


@bench_row("gpu_readopt", TITLE + " (CUDA VMM arena)", needs="cuda", heavy="8 GB of GPU memory, two daemon starts",
           params=GPU_PARAMS[:1])  # tensors; one restart each way, no reps
def gpu_readopt(options: BenchOptions) -> list[BenchResult]:
    return _readopt(options, "gpu_readopt", "cuda")


def _readopt(options: BenchOptions, row: str, transport: str) -> list[BenchResult]:
    from harness.bench.synthetic import write_synthetic

    tensors = options.value("tensors")
    shards = max(1, min(8, tensors // 40))
    work = scratch(options, "pg-readopt-")
    root = work / "sockets"
    root.mkdir(mode=0o700)
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"))
    digest = ""
    try:
        ckpt = work / "ckpt"
        write_synthetic(ckpt, shards, options.size_bytes // shards, tensors_per_shard=tensors // shards, seed=4)
        # The manifest: the successor knows its digest before reading a byte.
        subprocess.run([*_cli(), "promote", str(ckpt)], check=True, capture_output=True, timeout=3600, env=env)
        first, ready_a, wall_a = _start(ckpt, root, transport, env)
        digest = ready_a["digest"]
        _kill9(first, ready_a)
        second, ready_b, wall_b = _start(ckpt, root, transport, env)
    finally:
        if digest:
            _evict(root, digest, env)
        shutil.rmtree(work, ignore_errors=True)
    a, b = ready_a["ranks"][0], ready_b["ranks"][0]
    origin = b.get("origin")
    if origin != "adopted" or not b.get("adopt_seconds"):
        return [not_run(row, TITLE, f"the successor did not re-adopt (origin={origin!r}, "
                                    f"bytes_read={b.get('bytes_read')})")]
    return [BenchResult(
        row=row, title=f"{TITLE} ({transport}, {a['bytes'] / (1 << 30):.1f} GiB, {a['tensors']} tensors)",
        anchor=Figure("load from disk (read, hash, place)", float(a["load_seconds"]) * 1e3, "ms"),
        ours=Figure("re-adopt (fetch, import, map, prove)", float(b["adopt_seconds"]) * 1e3, "ms"),
        ratio=float(a["load_seconds"]) / float(b["adopt_seconds"]), ratio_meaning="faster", target=">= 50x",
        details={
            "transport": transport, "bytes": a["bytes"], "tensors": a["tensors"],
            "load_seconds": a["load_seconds"], "adopt_seconds": b["adopt_seconds"],
            "successor_bytes_read": b.get("bytes_read"), "generation": b.get("generation"),
            "wall_start_to_ready_disk_s": wall_a, "wall_start_to_ready_adopt_s": wall_b,
            "wall_ratio": wall_a / wall_b,
        },
        notes=(f"re-adoption includes the proof ({'seals and size' if transport == 'shm' else 'every resident checksum'}); "
               f"successor read {b.get('bytes_read')} bytes; "
               f"start to ready {wall_a:.2f} s from disk, {wall_b:.2f} s re-adopting "
               "(interpreter and torch start in both)"),
    )]
