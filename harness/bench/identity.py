"""Identity benchmark: restart identity cost on remote storage.

``restart_identity``: a many-shard checkpoint (66 shards by default; params
``shards``, ``shard_mb``, ``schemes``, ``latency_ms``) behind
``RemoteFS``, which charges a fixed latency per open, per read and (unless
``stat_latency_ms`` says otherwise) per stat and directory listing. Every
scheme runs against the same files in the same process, twice: with the
remote latency (``latency_ms``, default 50) and with none (0 ms, local page
cache), so one run shows both; opens, reads, stats and wall time are what
the shim observed. content/stat opens no shard and content/pinned does no
I/O in either variant; the table shows the counts beside the walls.

The table's stats are the thread pool's (``PRELOAD_GATE_STAT_BACKEND=pool``):
RemoteFS patches Python's ``os.stat`` and cannot see a stat io_uring issues
in the kernel.

content/stat is also reported in round trips (wall / one stat latency) at
the row's shard count and at each count in ``trip_shards`` (default 1000),
on checkpoints of 10 KiB shards (content/stat reads no byte of a shard),
median of ``trip_repeats`` (default 3), by
:func:`harness.bench.stat_trips.fuse_trips`: through a FUSE mirror that
answers every request after ``stat_latency_ms``, so the kernel sees every
stat, timed with io_uring (the judged figure where the kernel allows it),
with the pool prestarted (``PRELOAD_GATE_STAT_WORKERS``: its start outside
the clock, as at plugin registration) and cold (the check creates its own
threads). Where FUSE cannot be mounted (not root, no /dev/fuse) these rows
are RemoteFS's, the pool forced, and the notes say why.

The startup heap is frozen before any clock starts (as vLLM's engine core
does), so a full garbage collection of the imported vLLM and torch
objects does not land in one scheme's wall at random.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harness.bench import BenchOptions, BenchResult, Figure, bench_row, progress, scratch
from harness.bench import params as P
from harness.bench.fuse_fs import FuseUnavailableError
from harness.bench.remote_fs import IOCounts
from harness.bench.stat_trips import (
    cold_start,
    fuse_trips,
    local_uring_walls,
    measure,
    remote_trips,
    stat_backend,
)
from harness.bench.synthetic import write_synthetic
from preload.identity import anchors
from preload.promote import promote

# -- restart identity ------------------------------------------------------------


def _latencies(options: BenchOptions) -> list[tuple[float, float]]:
    """(open/read ms, stat/listing ms) per variant: the remote one, then local.

    ``latency_ms`` (default 50) is the remote variant; a 0 ms variant is
    always measured beside it, so one run shows what the latency costs each
    scheme and that ours does the same (zero) opens either way.
    """
    remote = options.value("latency_ms")
    stat = options.value("stat_latency_ms")
    stat = remote if stat is None else stat
    variants = [(remote, stat)]
    if (remote, stat) != (0.0, 0.0):
        variants.append((0.0, 0.0))
    return variants


def _how(t: dict) -> str:
    fs = "FUSE mirror" if t["fs"] == "fuse" else "RemoteFS"
    return f"io_uring, {fs}" if t["backend"] == "uring" else f"pool prestarted, {fs}"


def _trip_notes(t: dict, charged: str, repeats: int, fuse_refused: str | None) -> str:
    """Every way the stats were timed, with its CPU: the judged one first."""
    def ms(key: str) -> str:
        return f"{statistics.median(t[key]) * 1000:.0f} ms CPU"

    if t["fs"] == "fuse":
        where = "every request to a FUSE mirror answered after one latency (the kernel sees every stat)"
    else:
        where = f"{charged}; RemoteFS, the pool forced (FUSE rows not run: {fuse_refused})"
    parts = [f"{where}; medians of {repeats} checks"]
    if "uring_walls_s" in t:
        parts.append(f"io_uring (fresh ring each): {t['uring_round_trips']:.2f} round trips, {ms('uring_cpu_s')}, "
                     f"server {ms('uring_server_cpu_s')}")
    elif t["fs"] == "fuse":
        parts.append(f"io_uring not run: {t['uring_unavailable']}")
    parts.append(f"pool prestarted: {t['pool_round_trips']:.2f} round trips, {ms('prestarted_cpu_s')}")
    parts.append(f"cold (no PRELOAD_GATE_STAT_WORKERS: the check creates its threads): "
                 f"{t['cold_round_trips']:.2f} round trips, {ms('cold_cpu_s')}")
    return "; ".join(parts)


# (anchor, ours) pairs reported per latency variant.
_PAIRS = (
    ("header_only", "content/stat"),
    ("sampled_1k", "content/stat"),
    ("path_stat", "content/stat"),
    ("header_only", "content/pinned"),
)


_SCHEMES = ("header_only", "sampled_1k", "path_stat", "realpath", "content/stat", "content/pinned", "content/full")
_MS = P.number(0, 60_000, "milliseconds")  # a minute per request is already no storage


def _without(scheme: str, what: str) -> Callable[[Mapping[str, Any]], str | None]:
    """A parameter read only where ``schemes`` measures ``scheme``."""
    return lambda v: None if scheme in v["schemes"] else f"{what} only with {scheme} in schemes"


def _trips_unused(v: Mapping[str, Any]) -> str | None:
    stat = v["latency_ms"] if v["stat_latency_ms"] is None else v["stat_latency_ms"]
    if stat == 0:
        return "round trips are counted only under a stat latency > 0 (stat_latency_ms, else latency_ms)"
    return _without("content/stat", "round trips are counted")(v)


PARAMS = (
    P.Param("shards", P.integer(1, 100_000), 66),
    P.Param("shard_mb", P.number(0.001, 65_536, "MiB per shard"), 4.0),
    P.Param("latency_ms", _MS, 50.0, "default 50; each open and read of the remote variant"),
    P.Param("stat_latency_ms", _MS, None, "default: latency_ms; each stat and listing"),
    P.Param("header_impl", P.choice(*anchors.HEADER_IMPLS), "auto"),  # warms up and is reported whatever is timed
    P.Param("trip_shards", P.integers(1, 100_000), (1000,), unused=_trips_unused),
    P.Param("trip_repeats", P.integer(1, 100), 3, unused=_without("content/stat", "cold starts are repeated")),
    P.Param("schemes", P.subset(_SCHEMES), _SCHEMES, "default: all"),
)


@bench_row("restart_identity", "restart identity cost, many shards, with and without remote-storage latency",
           params=PARAMS)
def restart_identity(options: BenchOptions) -> list[BenchResult]:
    shards = options.value("shards")
    shard_bytes = int(options.value("shard_mb") * (1 << 20))
    variants = _latencies(options)
    impl = options.value("header_impl")
    extra = sorted(set(options.value("trip_shards")) - {shards})
    repeats = options.value("trip_repeats")
    work = scratch(options, "pg-bench-restart-")
    measured: dict[tuple[float, str], tuple[IOCounts, float]] = {}
    trips: dict[tuple[int, float], dict] = {}
    pairs_median: dict[float, dict] = {}
    fuse_refused: str | None = None  # why the FUSE mirror could not be mounted
    promoted: set[Path] = set()  # checkpoints promoted at their real path (the RemoteFS fallback)
    local_uring: list[float] | None = None  # content/stat on local disk through io_uring (None: not run)
    load_before = os.getloadavg()
    try:
        ckpt = work / "ckpt"
        write_synthetic(ckpt, shards, shard_bytes)
        cache = work / "cache"
        # Only the manifest is measured; the socket root is short so its
        # socket paths fit AF_UNIX wherever the scratch dir lives (promote checks).
        sockets = Path(tempfile.mkdtemp(prefix="pg-bs-", dir="/tmp"))
        promo = promote(ckpt, socket_root=sockets, cache_dir=cache, progress=False)
        shutil.rmtree(sockets, ignore_errors=True)
        header_impl = anchors.header_only(ckpt, impl).implementation  # import vLLM outside the clock
        anchors.content(ckpt, "full")  # and vLLM's file selection, which content/full asks
        every: dict[str, Callable[[], object]] = {
            "header_only": lambda: anchors.header_only(ckpt, impl),
            "sampled_1k": lambda: anchors.sampled_1k(ckpt),
            "path_stat": lambda: anchors.path_stat(ckpt),
            "realpath": lambda: anchors.realpath(ckpt),
            "content/stat": lambda: anchors.content(ckpt, "stat", cache_dir=cache),
            "content/pinned": lambda: anchors.content(ckpt, "pinned", expected_digest=promo.digest),
            "content/full": lambda: anchors.content(ckpt, "full"),
        }
        # --param schemes=content/stat,content/pinned: at 1,000 shards the
        # anchors take minutes per variant (three round trips per shard).
        assert tuple(every) == _SCHEMES, "the declared schemes are these"
        wanted = options.value("schemes")
        schemes = {k: v for k, v in every.items() if k in wanted}
        # The startup heap (vLLM, torch) is frozen, as vLLM's engine core does
        # after start (vllm.utils.gc_utils.freeze_gc_heap): a full collection of
        # it took up to 0.9 s here and landed in whichever scheme's clock happened
        # to allocate when it came due. Every scheme is measured this way.
        gc.collect()
        gc.freeze()
        # Same files, same process, variants back to back. RemoteFS sees only
        # stats issued from Python, so the pool issues them here.
        with stat_backend("pool"):
            for latency_ms, stat_ms in variants:
                for name, fn in schemes.items():
                    progress(f"restart_identity: {name} at {latency_ms:g} ms")
                    if name == "content/stat":
                        cold_start()  # as in a restarting engine
                    measured[(latency_ms, name)] = measure(ckpt, latency_ms / 1000, stat_ms / 1000, fn)
        if "content/stat" in schemes and (0.0, 0.0) in variants:
            local_uring = local_uring_walls(ckpt, cache, repeats)
        remote = [(lat, stat) for lat, stat in variants if stat > 0] if "content/stat" in schemes else []
        for latency_ms, stat_ms in remote:  # the pairs' content/stat: cold medians under RemoteFS
            pairs_median[stat_ms] = remote_trips(ckpt, cache, latency_ms, stat_ms, repeats)
        for n in [shards, *extra] if remote else []:
            tiny = work / f"ckpt-{n}"
            write_synthetic(tiny, n, 10 << 10)
            for latency_ms, stat_ms in remote:
                progress(f"restart_identity: content/stat round trips at {n} shards, {stat_ms:g} ms")
                if fuse_refused is None:
                    try:
                        trips[(n, stat_ms)] = fuse_trips(tiny, cache, stat_ms, repeats)
                        continue
                    except FuseUnavailableError as exc:
                        fuse_refused = str(exc)
                if n == shards:
                    trips[(n, stat_ms)] = pairs_median[stat_ms]
                    continue
                if tiny not in promoted:
                    socks = Path(tempfile.mkdtemp(prefix="pg-bs-", dir="/tmp"))
                    promote(tiny, socket_root=socks, cache_dir=cache, progress=False)
                    shutil.rmtree(socks, ignore_errors=True)
                    promoted.add(tiny)
                trips[(n, stat_ms)] = remote_trips(tiny, cache, latency_ms, stat_ms, repeats)
        load_after = os.getloadavg()
    finally:
        gc.unfreeze()
        shutil.rmtree(work, ignore_errors=True)
    table = [
        {"latency_ms": lat, "stat_latency_ms": stat, "scheme": name, **counts.to_json(), "wall_s": round(wall, 6)}
        for lat, stat in variants
        for name in schemes
        for counts, wall in [measured[(lat, name)]]
    ]
    details = {
        "shards": shards,
        "shard_bytes": shard_bytes,
        "latency_ms": [lat for lat, _ in variants],
        "stat_latency_ms": [stat for _, stat in variants],
        "header_only_implementation": header_impl,
        "table": table,
        # A shared machine: other load inflates walls made of thread wake-ups most.
        "loadavg_1m_before_after": [load_before[0], load_after[0]],
        "cpu_count": os.cpu_count(),
    }
    results = []
    for latency_ms, stat_ms in variants:
        where = f"{latency_ms:g} ms remote fs" if latency_ms or stat_ms else "local fs (0 ms)"
        charged = f"opens and reads {latency_ms:g} ms each; stats and listings {stat_ms:g} ms each"
        for n in [shards, *extra] if stat_ms > 0 else []:
            if (n, stat_ms) not in trips:
                continue
            t = trips[(n, stat_ms)]
            results.append(
                BenchResult(
                    row="restart_identity",
                    title=f"restart identity, {n} shards, {where}: content/stat in round trips",
                    anchor=Figure("one stat round trip", stat_ms / 1000, "s"),
                    ours=Figure(f"content/stat ({t['stats']} stats, concurrent, {_how(t)})", t["wall_s"], "s"),
                    ratio=t["wall_s"] / (stat_ms / 1000),
                    ratio_meaning="round trips spent (content/stat wall / one stat latency)",
                    target=("<= 3 round trips at any shard count (stats issued concurrently: io_uring where the "
                            "kernel allows it, else the pool PRELOAD_GATE_STAT_WORKERS starts at plugin "
                            "registration)"),
                    details={**details, "variant_latency_ms": latency_ms, "variant_stat_latency_ms": stat_ms,
                             "trip_shards": n, **t},
                    notes=_trip_notes(t, charged, repeats, fuse_refused),
                )
            )
        for anchor, ours in _PAIRS:
            if anchor not in schemes or ours not in schemes:
                continue
            (ac, aw), (oc, ow) = measured[(latency_ms, anchor)], measured[(latency_ms, ours)]
            note = charged + ("; ours does no checkpoint I/O at all, so no ratio" if not oc.touched else "")
            if ours == "content/stat":
                note += "; the stats are the thread pool's (RemoteFS sees only stats issued from Python)"
            # A 10 s anchor is steady in one run; a 50 ms check is not (one
            # scheduler stall on a shared machine doubles it): ours is the
            # median of the cold starts above where they were measured.
            median = pairs_median.get(stat_ms) if ours == "content/stat" else None
            if median is not None:
                note += (f"; ours is the median of {repeats} cold starts (the table's single run: "
                         f"{ow:.3g} s)")
                ow = median["cold_wall_s"]  # cold: this ratio needs no PRELOAD_GATE_STAT_WORKERS
            extra_details: dict = {}
            if ours == "content/stat" and not (latency_ms or stat_ms) and local_uring:
                # The table's stats are the pool's (the shim counts them); on local
                # disk an engine where io_uring is allowed issues them through it.
                extra_details["uring_walls_s"] = local_uring
                note += (f"; through io_uring (the default where the kernel allows it, not counted by the "
                         f"shim): {statistics.median(local_uring):.3g} s, median of {repeats}")
            results.append(
                BenchResult(
                    row="restart_identity",
                    title=f"restart identity, {shards} shards, {where} ({anchor} vs {ours})",
                    anchor=Figure(f"{anchor} ({ac.opens} opens, {ac.reads} reads, {ac.stats} stats)", aw, "s"),
                    ours=Figure(f"{ours} ({oc.opens} opens, {oc.reads} reads, {oc.stats} stats)", ow, "s"),
                    ratio=(aw / ow) if oc.touched and ow > 0 else None,
                    ratio_meaning="anchor wall / ours wall",
                    target="content/stat opens no shard; content/pinned touches nothing",
                    details={**details, "variant_latency_ms": latency_ms, "variant_stat_latency_ms": stat_ms,
                             **({"cold_wall_s": ow, "cold_walls_s": median["cold_walls_s"]} if median else {}),
                             **extra_details},
                    notes=note,
                )
            )
    return results
