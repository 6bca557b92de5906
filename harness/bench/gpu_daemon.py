"""GPU benchmark ``gpu_daemon_attach``: engine restart through a real daemon.

A daemon (``preload-gate preload --stage raw --transport cuda``) holds a
synthetic checkpoint of ``--size`` bytes: connect, hello, get_state, attach,
verify_resident, against loading the same checkpoint from disk (page cache
warm) with ``safetensors.torch.load_file(device="cuda")``. Figures are
medians of ``reps`` runs; CUDA work is synchronised before each clock read.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.bench import BenchOptions, BenchResult, Figure, bench_row, scratch
from harness.bench.gpu import GPU_PARAMS, cuda_time, gpu_params, median_ms
from preload.daemon.ready import READY, NotReadyError, start_preload, wait_ready


def _start_daemon(ckpt: Path, root: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = start_preload([str(ckpt), "--stage", "raw", "--transport", "cuda", "--identity", "full",
                          "--socket-root", str(root)], exit_with_parent=True)  # a killed bench leaves none
    try:
        return proc, wait_ready(proc, READY, timeout_s=None)
    except NotReadyError as exc:
        raise RuntimeError(f"daemon exited with {exc.returncode} before it was ready") from None


@bench_row("gpu_daemon_attach", "engine restart through the daemon: attach+verify vs disk load", needs="cuda",
           params=GPU_PARAMS)
def gpu_daemon_attach(options: BenchOptions) -> list[BenchResult]:
    title = "restart through the daemon (connect, get_state, attach, verify) vs safetensors load to GPU"
    import torch
    from safetensors.torch import load_file

    from harness.bench.synthetic import write_synthetic
    from pgbase.shards import shard_paths
    from preload.checksum import verify_resident
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    tensors, reps = gpu_params(options)
    shards = max(1, min(8, tensors // 40))
    work = scratch(options, "pg-gpu-")
    root = work / "sockets"
    root.mkdir(mode=0o700)
    try:
        ckpt = work / "ckpt"
        t0 = time.perf_counter()
        write_synthetic(ckpt, shards, options.size_bytes // shards, tensors_per_shard=tensors // shards, seed=3)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        daemon, ready = _start_daemon(ckpt, root)
        daemon_start_s = time.perf_counter() - t0
        try:
            torch.cuda.init()
            torch.empty(1, device="cuda")
            key = raw_key(ckpt, ready["digest"], "cuda")
            samples, attach_only, verify_only, connect_only, state_only = [], [], [], [], []
            for r in range(reps + 1):
                t0 = time.perf_counter()
                client = DaemonClient.connect(ready["socket_dir"], 0)
                tc = time.perf_counter()
                state = client.get_state(key)
                ts = time.perf_counter()
                att = state.attach()
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                verify_resident(att.tensors, state.layout, getattr(state, "checksums", None) or {})
                t2 = time.perf_counter()
                client.report_attach()  # as an engine does once its weights are in use
                client.close()
                att.close()
                del att, state
                if r:  # the first round compiles the checksum kernel
                    samples.append(t2 - t0)
                    attach_only.append(t1 - t0)
                    verify_only.append(t2 - t1)
                    connect_only.append(tc - t0)
                    state_only.append(ts - tc)
            paths = shard_paths(ckpt)
            disk = cuda_time(lambda: [load_file(str(p), device="cuda") for p in paths], 2)
        finally:
            daemon.terminate()
            daemon.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    nbytes = ready["ranks"][0]["bytes"]
    return [BenchResult(
        row="gpu_daemon_attach",
        title=f"{title} ({nbytes / (1 << 30):.1f} GiB, {ready['ranks'][0]['tensors']} tensors)",
        anchor=Figure("safetensors load_file to cuda (page cache warm)", min(disk) * 1e3, "ms"),
        ours=Figure("daemon attach + verify", median_ms(samples), "ms"),
        ratio=min(disk) / statistics.median(samples), ratio_meaning="faster", target="< 15 ms",
        details={
            "bytes": nbytes, "tensors": ready["ranks"][0]["tensors"], "e2e_ms": [s * 1e3 for s in samples],
            "attach_ms": [s * 1e3 for s in attach_only], "verify_ms": [s * 1e3 for s in verify_only],
            "connect_hello_ms": [s * 1e3 for s in connect_only], "get_state_ms": [s * 1e3 for s in state_only],
            "disk_load_s": disk, "write_checkpoint_s": write_s, "daemon_start_s": daemon_start_s,
            "daemon_load_seconds": ready["ranks"][0].get("load_seconds"),
            "device": torch.cuda.get_device_name(0),
        },
        notes="fresh connection each round; daemon start includes reading and hashing every byte",
    )]
