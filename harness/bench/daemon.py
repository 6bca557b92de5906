"""Daemon rows: what a restart costs with the daemon versus without it.

``daemon_weight_load``: one ``auto`` engine and one ``verified_cache``
engine (hitting a ``loaded``-stage daemon) on the same checkpoint, run one
after the other in the same bench run through :func:`harness.engine.run_engine`
(the gate's runner). Three figures, each auto beside verified_cache with
its ratio: the wall time of the CPU model runner's ``get_model`` call (the
weight-load phase: loader, weights, processing; nothing else), and the
runner's ``ready`` and ``first_token`` marks (process start to engine
ready, and to the first greedy token answered: what a restart costs a
user). The load event's seconds for the cached one go in details.
Checkpoint: the tiny fixture by default, ``model=smollm2`` for SmolLM2-135M.

``daemon_peak_memory``: a raw-stage daemon's peak resident memory while it
reads, hashes and places a synthetic checkpoint (``size`` bytes, default
256 MiB), as a multiple of the weight bytes, beside the anchor: a fresh
process doing ``safetensors.torch.load_file`` of the same files. Peak is
``VmHWM``, minus the process's RSS just before loading. With ``model=...``
the loaded stage is measured too (vLLM's own model, weights swapped into the
arena before ``load_weights``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import BenchError, BenchOptions, BenchResult, Figure, bench_row, scratch
from harness.bench import params as P
from harness.engine import EngineResult, EngineSpec, run_engine
from preload.daemon.ready import READY, NotReadyError, start_preload, stop_daemon, wait_ready

_LOAD_LINE = re.compile(r"^PG_WEIGHT_LOAD_SECONDS ([\d.]+)$", re.M)


def _engine(model: Path, workdir: Path, env: dict[str, str], load_format: str = "auto",
            extra: dict[str, Any] | None = None) -> tuple[EngineResult, float]:
    """One engine through the gate's runner, wrapped by this module to time ``get_model``."""
    spec = EngineSpec(checkpoint=str(model), load_format=load_format, extra_config=extra, env=env)
    result = run_engine(spec, workdir, timeout_s=900, worker="harness.bench.daemon")
    if not result.ok:
        raise BenchError(f"{load_format} engine failed: {result.error}: {result.log_tail[-2000:]}")
    m = _LOAD_LINE.search((workdir / "engine.log").read_text(encoding="utf-8", errors="replace"))
    if not m:
        raise BenchError(f"{load_format} engine printed no PG_WEIGHT_LOAD_SECONDS line")
    return result, float(m.group(1))


class _Daemon:
    def __init__(self, ckpt: Path, root: Path, env: dict[str, str], *args: str) -> None:
        # exit_with_parent: a bench killed by SIGKILL leaves no resident daemon behind.
        self.proc = start_preload([str(ckpt), "--socket-root", str(root), *args], env=env, stderr=subprocess.DEVNULL,
                                  exit_with_parent=True)
        try:
            self.ready = wait_ready(self.proc, READY, timeout_s=None)
        except NotReadyError as exc:
            raise BenchError(f"daemon exited with {exc.returncode} before it was ready") from None

    def stop(self) -> None:
        stop_daemon(self.proc, 60)


def _checkpoint(options: BenchOptions, work: Path) -> Path:
    model = options.value("model")
    if model == "tiny":
        from fixtures.tiny import write_tiny

        return write_tiny(work / "tiny", arch="qwen3", shards=1, seed=0)
    if model == "smollm2":
        from fixtures.smollm2 import write_smollm2

        return write_smollm2(work / "smollm2", progress=False)
    if Path(model).is_dir():
        return Path(model)
    raise BenchError(f"model={model!r}: use {P.MODEL.allowed}")


# (figure, label, what it times) reported per engine pair, auto beside verified_cache.
_PHASES = (
    ("weight_load", "weight-load phase", "wall time of the model runner's get_model"),
    ("ready", "engine ready", "process start to LLM() returned (imports, load, warm-up)"),
    ("first_token", "time to first token", "process start to the first greedy token answered"),
)


@bench_row("daemon_weight_load", "engine weight load, ready and first token: verified_cache hit vs auto",
           heavy="two vLLM engine starts and a loaded-stage daemon (about 1-2 min on 2 cores)",
           params=(P.Param("model", P.MODEL, "tiny"),))
def daemon_weight_load(options: BenchOptions) -> list[BenchResult]:
    from preload.promote import promote

    model = options.value("model")
    work = scratch(options, "pg-bench-d-")
    root = Path(tempfile.mkdtemp(prefix="pg-b-", dir="/tmp"))
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PRELOAD_GATE_EVENTS", None)
    # The engine core in the worker's process, so get_model can be timed there.
    engine_env = {"PRELOAD_GATE_CACHE": str(work / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        ckpt = _checkpoint(options, work)
        promote(ckpt, socket_root=root, cache_dir=work / "cache")
        auto, auto_load = _engine(ckpt, work / "auto", engine_env)
        daemon = _Daemon(ckpt, root, env, "--stage", "loaded")
        try:
            cached, cached_load = _engine(ckpt, work / "cached", engine_env, "verified_cache",
                                          {"socket_root": str(root), "fallback": False})
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    event = cached.events[0] if cached.events else {}
    if event.get("outcome") != "hit" or cached.token_ids != auto.token_ids:
        raise BenchError(f"cached engine did not hit with identical tokens: {event or 'no load event'}")
    figures = {
        "weight_load": (auto_load, cached_load),
        "ready": (auto.timings["ready"], cached.timings["ready"]),
        "first_token": (auto.timings["first_token"], cached.timings["first_token"]),
    }
    details = {
        "model": model,
        "seconds": {k: {"auto": a, "verified_cache": c} for k, (a, c) in figures.items()},
        "timings": {"auto": auto.timings, "verified_cache": cached.timings},
        "event_seconds": event.get("seconds"), "bytes": event.get("bytes"), "tensors": event.get("tensors"),
        "daemon_load_seconds": daemon.ready["ranks"][0]["load_seconds"],
        "vllm_version": auto.vllm_version, "loadavg_1m": os.getloadavg()[0],
        "table": [
            {"figure": label, "auto_s": round(a, 4), "verified_cache_s": round(c, 4),
             "ratio": f"{a / c:.2f}x" if c > 0 else "n/a"}
            for key, label, _ in _PHASES for a, c in [figures[key]]
        ],
    }
    # vLLM's import is most of a tiny engine's start and the noisiest part on a
    # shared machine; the start after it shows what the load format changes.
    a, c = (t["ready"] - t["imported"] for t in (auto.timings, cached.timings))
    details["table"].append({"figure": "ready after vLLM import (ready - imported)", "auto_s": round(a, 4),
                             "verified_cache_s": round(c, 4), "ratio": f"{a / c:.2f}x" if c > 0 else "n/a"})
    results = []
    for key, label, what in _PHASES:
        a, c = figures[key]
        results.append(BenchResult(
            row="daemon_weight_load", title=f"{label} ({model}, CPU)",
            anchor=Figure("auto", a, "s"), ours=Figure("verified_cache hit", c, "s"),
            ratio=a / c if c > 0 else None, ratio_meaning="auto / verified_cache",
            details=details,
            notes=f"{what}; same checkpoint, same run, tokens identical; the cached side includes "
                  "digest resolution (stat), socket, attach and CPU processing; "
                  f"1-min loadavg {details['loadavg_1m']:.1f} on {os.cpu_count()} cores",
        ))
    return results


_ANCHOR_SCRIPT = r"""
import json, sys
from pathlib import Path
from safetensors.torch import load_file
def rss(f):
    for line in open("/proc/self/status"):
        if line.startswith(f + ":"):
            return int(line.split()[1]) * 1024
base = rss("VmRSS")
# Copied into memory of its own, as an engine's weight loader does (load_file alone maps lazily).
held = [{k: v.clone() for k, v in load_file(p).items()} for p in sorted(Path(sys.argv[1]).glob("*.safetensors"))]
print(json.dumps({"baseline": base, "peak": rss("VmHWM")}))
"""


def _weight_bytes(ckpt: Path) -> int:
    from pgbase.shards import read_header, shard_paths

    return sum(t.nbytes for p in shard_paths(ckpt) for t in read_header(p).tensors)


@bench_row("daemon_peak_memory", "daemon peak memory as a multiple of weight bytes",
           params=(P.Param("size", P.SIZE, 256 << 20, "default 256M"),
                   P.Param("model", P.MODEL, None, "default: none; also a loaded-stage daemon on it")))
def daemon_peak_memory(options: BenchOptions) -> list[BenchResult]:
    from harness.bench.synthetic import write_synthetic

    work = scratch(options, "pg-bench-m-")
    root = Path(tempfile.mkdtemp(prefix="pg-b-", dir="/tmp"))
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    size = options.value("size")
    results = []
    try:
        cases = [("raw", write_synthetic(work / "synthetic", 2, size // 2, tensors_per_shard=8)[0].parent)]
        if options.value("model") is not None:
            cases.append(("loaded", _checkpoint(options, work)))
        for stage, ckpt in cases:
            weights = _weight_bytes(ckpt)
            anchor = json.loads(subprocess.run([sys.executable, "-c", _ANCHOR_SCRIPT, str(ckpt)], check=True,
                                               capture_output=True, text=True, env=env).stdout)
            start = time.perf_counter()
            d = _Daemon(ckpt, root, env, "--stage", stage, "--identity", "full")
            wall = time.perf_counter() - start
            d.stop()
            rank = d.ready["ranks"][0]
            ours = (rank["peak_rss_bytes"] - rank["baseline_rss_bytes"]) / weights
            theirs = (anchor["peak"] - anchor["baseline"]) / weights
            results.append(BenchResult(
                row="daemon_peak_memory", title=f"daemon peak memory ({stage} stage)",
                anchor=Figure("safetensors load_file", theirs, "x weights"),
                ours=Figure(f"daemon {stage}", ours, "x weights"),
                ratio=theirs / ours if ours > 0 else None, ratio_meaning="anchor / ours",
                target="<= 1.1x weights",
                details={"weight_bytes": weights, "daemon": rank, "anchor": anchor, "daemon_wall_s": wall},
                notes="peak VmHWM minus RSS just before loading (after vLLM's imports for the loaded stage)",
            ))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _timed_worker(argv: list[str]) -> None:
    """:mod:`harness.engine_worker` with the model runner's ``get_model`` timed
    (the CPU runner logs no load time of its own); the line goes to engine.log."""
    import importlib

    from harness import engine_worker  # sets the worker's T0 first, as when run directly

    runner = importlib.import_module("vllm.v1.worker.cpu_model_runner")

    inner = runner.get_model

    def timed_get_model(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        model = inner(*args, **kwargs)
        print(f"PG_WEIGHT_LOAD_SECONDS {time.perf_counter() - start:.6f}", flush=True)
        return model

    setattr(runner, "get_model", timed_get_model)  # noqa: B010 (a module attribute mypy cannot see)
    engine_worker.main(argv)


if __name__ == "__main__":
    _timed_worker(sys.argv[1:])
