"""Load: many engines attaching to one daemon at once (CPU shm transport).

``attach_load``: a raw-stage daemon holds a synthetic checkpoint; N clients
(threads, released together by a barrier) each connect, hello, get_state and
attach, and hold their mapping until all are done. The anchor is what those
engines do without a daemon: N concurrent ``safetensors.torch.load_file``
of the same checkpoint, each tensor copied into memory of its own as an
engine's weight loader does (page cache warm: the anchor at its best). Both
sides run in the same process, on the same files, alternating rounds.

Figures are per-client latencies; the row reports p50 side by side and the
p50/p90/p99 of both in ``details``. ``attach_many`` is also what the load
test uses (it then checks every client's tensors by digest).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.bench import BenchOptions, BenchResult, Figure, bench_row, scratch
from harness.bench import params as P
from preload.budget import MAX_CONNECTIONS


@dataclass
class ClientResult:
    """One client's attach: seconds from connect to mapped tensors, and what it got."""

    seconds: float
    tensors: dict[str, Any]
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered) / 100) - 1))
    return ordered[k]


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def concurrently(n: int, work: Callable[[int], ClientResult], timeout_s: float = 120.0) -> list[ClientResult]:
    """Run ``work(i)`` in ``n`` threads released at once; results in order.

    Every thread waits on a second barrier before returning, so all clients
    hold what they attached at the same time (the daemon serves N live
    engines, not N engines one after another).
    """
    start = threading.Barrier(n)
    hold = threading.Barrier(n)
    results: list[ClientResult | None] = [None] * n

    def run(i: int) -> None:
        try:
            start.wait(timeout_s)
            results[i] = work(i)
        except BaseException as exc:  # recorded, never swallowed: the caller checks
            results[i] = ClientResult(float("nan"), {}, f"{type(exc).__name__}: {exc}")
        try:
            hold.wait(timeout_s)
        except threading.BrokenBarrierError:
            pass

    threads = [threading.Thread(target=run, args=(i,), name=f"attach-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"clients {missing} did not finish within {timeout_s:g} s")
    return [r for r in results if r is not None]


def attach_many(socket_dir: Path, checkpoint: Path, digest: str, clients: int) -> tuple[list[ClientResult], list[Any]]:
    """``clients`` engine-side attaches at once; (results, attachments to close)."""
    from preload.client import DaemonClient
    from preload.daemon.raw import raw_key

    key = raw_key(checkpoint, digest, "shm")
    attachments: list[Any] = []
    lock = threading.Lock()

    def one(_i: int) -> ClientResult:
        t0 = time.perf_counter()
        c = DaemonClient.connect(socket_dir, 0, client="load")
        try:
            att = c.get_state(key).attach()
            c.report_attach()  # as an engine does once its model is built
        finally:
            c.close()
        seconds = time.perf_counter() - t0
        with lock:
            attachments.append(att)
        return ClientResult(seconds, att.tensors)

    return concurrently(clients, one), attachments


def load_many(checkpoint: Path, clients: int) -> list[ClientResult]:
    """The anchor: ``clients`` concurrent ``safetensors`` loads of every shard."""
    from safetensors.torch import load_file

    from pgbase.shards import shard_paths

    paths = shard_paths(checkpoint)

    def one(_i: int) -> ClientResult:
        t0 = time.perf_counter()
        tensors: dict[str, Any] = {}
        for p in paths:
            # load_file maps the file lazily; an engine copies every tensor
            # into its parameters, so the anchor does too.
            tensors.update({k: v.clone() for k, v in load_file(str(p)).items()})
        return ClientResult(time.perf_counter() - t0, tensors)

    return concurrently(clients, one)


@bench_row("attach_load", "N engines attaching to one daemon at once (CPU shm)",
           # clients: at most as many engines as one daemon serves at once (more are turned away).
           params=(P.Param("clients", P.integer(1, MAX_CONNECTIONS, "engines at once"), 32),
                   P.Param("rounds", P.integer(1, 100), 3),
                   P.Param("load_mb", P.number(0.001, 65_536, "MiB of weights"), 32.0),
                   P.Param("load_shards", P.integer(1, 10_000), 4)))
def attach_load(options: BenchOptions) -> list[BenchResult]:
    from harness.bench.synthetic import write_synthetic
    from harness.daemon_process import DaemonProcess
    from preload.promote import promote

    clients = options.value("clients")
    rounds = options.value("rounds")
    size_mb = options.value("load_mb")
    shards = options.value("load_shards")
    work = scratch(options, "pg-bench-load-")
    # AF_UNIX paths are short; keep the socket root under /tmp.
    sockets = Path(tempfile.mkdtemp(prefix="pg-load-", dir="/tmp"))
    try:
        ckpt = work / "ckpt"
        write_synthetic(ckpt, shards, int(size_mb * (1 << 20)) // shards)
        promotion = promote(ckpt, socket_root=sockets, cache_dir=work / "cache", progress=False)
        ours: list[float] = []
        anchor: list[float] = []
        with DaemonProcess(str(ckpt), str(sockets), work / "daemon.log",
                           ["--stage", "raw", "--expect-digest", promotion.digest]) as daemon:
            daemon.start()
            sdir = Path(daemon.ready["socket_dir"])
            solo, att = attach_many(sdir, ckpt, promotion.digest, 1)
            for a in att:
                a.close()
            for _ in range(rounds):
                results, att = attach_many(sdir, ckpt, promotion.digest, clients)
                errors = [r.error for r in results if r.error]
                if errors:
                    raise RuntimeError(f"attach failed under load: {errors[0]}")
                ours += [r.seconds for r in results]
                for a in att:
                    a.close()
                del results, att
                loaded = load_many(ckpt, clients)
                anchor += [r.seconds for r in loaded]
                del loaded
        o, a = percentiles(ours), percentiles(anchor)
        table = [
            {"side": "safetensors load_file (anchor)", "clients": clients, "samples": len(anchor),
             **{k: f"{v * 1e3:.2f} ms" for k, v in a.items()}},
            {"side": "daemon attach (ours)", "clients": clients, "samples": len(ours),
             **{k: f"{v * 1e3:.2f} ms" for k, v in o.items()}},
            {"side": "daemon attach, one client alone", "clients": 1, "samples": len(solo),
             "p50": f"{solo[0].seconds * 1e3:.2f} ms", "p90": "", "p99": ""},
        ]
        return [BenchResult(
            row="attach_load",
            title=f"{clients} engines at once, {size_mb:g} MB checkpoint: weights ready (p50)",
            anchor=Figure("safetensors load_file p50", a["p50"] * 1e3, "ms"),
            ours=Figure("daemon attach p50", o["p50"] * 1e3, "ms"),
            ratio=a["p50"] / o["p50"] if o["p50"] > 0 else None,
            ratio_meaning="times faster than each engine loading from (warm) disk",
            details={"table": table, "ours": o, "anchor": a, "solo_attach_s": solo[0].seconds,
                     "clients": clients, "rounds": rounds, "bytes": sum(s.size for s in promotion.manifest.shards),
                     "mean_ours_s": statistics.fmean(ours), "mean_anchor_s": statistics.fmean(anchor)},
            notes=f"p99 ours {o['p99'] * 1e3:.1f} ms vs anchor {a['p99'] * 1e3:.1f} ms; clients are threads "
                  "of one process (one GIL), released by a barrier, holding what they got until all finish",
        )]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
