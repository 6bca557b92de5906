"""Bench row: how long a bad invocation takes to say so, on a large checkpoint.

Preflight checks (socket root, AF_UNIX length, health port, cache) need no
weights, so a refusal should cost the same on 1 GiB as on 1 MiB. The anchor
is what the same mistake cost before they ran first: the whole read and hash
of the checkpoint (``promote`` on a good socket root, timed here), after
which the old code failed. Ours is the refusal itself, timed two ways: the
CLI as a user runs it (Python start-up included) and the in-process check.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.bench import BenchOptions, BenchResult, Figure, bench_row, scratch
from harness.bench.synthetic import write_synthetic

MIN_BYTES = 1 << 30


def _cli(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "preload_gate", *argv], capture_output=True, text=True,
                       env=env, timeout=3600)
    return time.perf_counter() - t0, p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


@bench_row("preflight_failure", "Bad invocation on a >= 1 GiB checkpoint: time to refuse",
           heavy="writes and hashes a checkpoint of at least 1 GiB")
def preflight_failure(options: BenchOptions) -> list[BenchResult]:
    from preload.preflight import PreflightError, preflight_promote

    size = max(options.size_bytes, MIN_BYTES)
    work = scratch(options, "pg-bench-preflight-")
    busy = socket.socket()
    sock = Path("/nonexistent")
    try:
        ckpt = work / "ckpt"
        write_synthetic(ckpt, shards=4, shard_bytes=size // 4)
        env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"))
        sock = Path(tempfile.mkdtemp(prefix="pg-bp-", dir="/tmp"))  # short: fits AF_UNIX
        missing_root = str(work / "no" / "such" / "root")
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        refusals = {
            "promote, socket root under a missing directory": ["promote", str(ckpt), "--socket-root", missing_root],
            "preload, busy --health-port": ["preload", str(ckpt), "--stage", "raw", "--socket-root", str(sock),
                                            "--health-port", port],
        }
        rows = []
        for what, argv in refusals.items():
            secs, rc, line = _cli(argv, env)
            rows.append({"refusal": what, "exit": rc, "seconds": round(secs, 3), "line": line[:120]})
        t0 = time.perf_counter()
        try:
            preflight_promote(ckpt, missing_root, work / "cache")
        except PreflightError:
            pass
        in_process = time.perf_counter() - t0
        full_s, full_rc, _ = _cli(["promote", str(ckpt), "--socket-root", str(sock)], env)
        worst = max(r["seconds"] for r in rows)
        return [BenchResult(
            row="preflight_failure", title="Bad invocation on a >= 1 GiB checkpoint: time to refuse",
            anchor=Figure("read + hash first (old order)", full_s, "s"),
            ours=Figure("refusal, CLI wall (slowest)", worst, "s"),
            ratio=full_s / worst if worst > 0 else None, ratio_meaning="x sooner than reading first",
            target="< 1 s, independent of checkpoint size",
            details={"bytes": size, "in_process_preflight_s": round(in_process, 6), "anchor_exit": full_rc,
                     "table": rows},
            notes=f"{size / (1 << 30):.2f} GiB in 4 shards; every refusal exit 2, one line; "
                  f"in-process check {in_process * 1e3:.2f} ms",
        )]
    finally:
        busy.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
