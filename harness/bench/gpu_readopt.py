"""GPU benchmark ``gpu_readopt``: a daemon restart that re-adopts its arena vs one that loads it.

A daemon (``preload-gate preload --stage raw --transport cuda``) loads a
synthetic checkpoint of ``--size`` bytes from disk (page cache warm: it was
just written), reading and hashing every byte, and deposits its arena in
the socket directory's fd store; its processes are then killed with
SIGKILL. A successor started with the same arguments takes the arena over
from the store and proves it (every resident checksum recomputed over the
adopted bytes) before it serves. The row compares what each start spent on
its weights: ``load_seconds`` of the first (read, hash, place) against
``adopt_seconds`` of the successor (fetch, import, map, prove), from the
ranks' own ready lines, and gives the wall time from start to ready of
both beside them (interpreter, torch and CUDA start included, the same for
both).

Where the successor did not re-adopt (no fd store in this tree, or it
loaded from disk) the row says so and claims nothing.
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
from harness.bench.gpu import GPU_PARAMS
from preload.daemon.ready import READY, NotReadyError, start_preload, wait_ready

ROW = "gpu_readopt"
TITLE = "daemon restart to ready: re-adopt the arena (including the proof) vs load it from disk"


def _start(ckpt: Path, root: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any], float]:
    t0 = time.perf_counter()
    proc = start_preload([str(ckpt), "--stage", "raw", "--transport", "cuda", "--identity", "full",
                          "--socket-root", str(root)], new_session=True)
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


def _evict(root: Path, digest: str) -> None:
    """Drop what the store still holds (it would keep 8 GiB of device memory)."""
    subprocess.run([*_cli(), "stop", "--socket-root", str(root), digest], capture_output=True, timeout=120)


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "preload_gate"]


@bench_row(ROW, TITLE, needs="cuda", heavy="8 GB of GPU memory, two daemon starts",
           params=GPU_PARAMS[:1])  # tensors; one restart each way, no reps
def gpu_readopt(options: BenchOptions) -> list[BenchResult]:
    from harness.bench.synthetic import write_synthetic

    tensors = options.value("tensors")
    shards = max(1, min(8, tensors // 40))
    work = scratch(options, "pg-readopt-")
    root = work / "sockets"
    root.mkdir(mode=0o700)
    digest = ""
    try:
        ckpt = work / "ckpt"
        write_synthetic(ckpt, shards, options.size_bytes // shards, tensors_per_shard=tensors // shards, seed=4)
        first, ready_a, wall_a = _start(ckpt, root)
        digest = ready_a["digest"]
        _kill9(first, ready_a)
        second, ready_b, wall_b = _start(ckpt, root)
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(60)
        except subprocess.TimeoutExpired:
            _kill9(second, ready_b)
    finally:
        if digest:
            _evict(root, digest)
        shutil.rmtree(work, ignore_errors=True)
    a, b = ready_a["ranks"][0], ready_b["ranks"][0]
    origin = b.get("origin")
    if origin != "adopted" or not b.get("adopt_seconds"):
        return [not_run(ROW, TITLE, f"the successor did not re-adopt (origin={origin!r}, "
                                    f"bytes_read={b.get('bytes_read')}): no fd store in this tree, or it refused")]
    proof = b.get("proof") or {}
    return [BenchResult(
        row=ROW, title=f"{TITLE} ({a['bytes'] / (1 << 30):.1f} GiB, {a['tensors']} tensors)",
        anchor=Figure("load from disk (read, hash, place)", float(a["load_seconds"]) * 1e3, "ms"),
        ours=Figure("re-adopt (fetch, import, map, prove)", float(b["adopt_seconds"]) * 1e3, "ms"),
        ratio=float(a["load_seconds"]) / float(b["adopt_seconds"]), ratio_meaning="faster", target=">= 50x",
        details={
            "bytes": a["bytes"], "tensors": a["tensors"], "load_seconds": a["load_seconds"],
            "adopt_seconds": b["adopt_seconds"], "proof": proof, "successor_bytes_read": b.get("bytes_read"),
            "wall_start_to_ready_disk_s": wall_a, "wall_start_to_ready_adopt_s": wall_b,
            "wall_ratio": wall_a / wall_b,
        },
        notes=(f"proof {proof.get('method')} over {proof.get('tensors')} tensors in "
               f"{float(proof.get('seconds') or 0) * 1e3:.2f} ms; start to ready {wall_a:.2f} s from disk, "
               f"{wall_b:.2f} s re-adopting (interpreter, torch and CUDA start in both)"),
    )]
