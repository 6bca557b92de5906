"""Daemon rows: what a restart costs with the daemon versus without it.

``daemon_weight_load``: one ``auto`` engine and one ``verified_cache``
engine (hitting a ``loaded``-stage daemon) on the same checkpoint, run one
after the other in the same bench run; the figure is the wall time of the
CPU model runner's ``get_model`` call in each (the weight-load phase:
loader, weights, processing; nothing else),
plus the load event's seconds for the cached one. Checkpoint: the tiny
fixture by default, ``model=smollm2`` for SmolLM2-135M.

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import BenchError, BenchOptions, BenchResult, Figure, bench_row, default_workdir

_LOAD_LINE = re.compile(r"^PG_WEIGHT_LOAD_SECONDS ([\d.]+)$", re.M)
PROMPTS = ["The capital of France is", "1 2 3 4"]


def _engine(model: Path, env: dict[str, str], spec: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "harness.bench.daemon", json.dumps({"model": str(model), **spec})],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BenchError(f"engine failed (rc {proc.returncode}): {log[-2000:]}")
    m = _LOAD_LINE.search(log)
    if not m:
        raise BenchError("engine printed no PG_WEIGHT_LOAD_SECONDS line")
    tokens = next(json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {"load_s": float(m.group(1)), "tokens": tokens}


class _Daemon:
    def __init__(self, ckpt: Path, root: Path, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preload_gate.cli", "preload", str(ckpt), "--socket-root", str(root), *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise BenchError(f"daemon exited with {self.proc.returncode} before it was ready")
        self.ready = json.loads(line)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _checkpoint(options: BenchOptions, work: Path) -> Path:
    model = options.param("model", "tiny")
    if model == "tiny":
        from fixtures.tiny import write_tiny

        return write_tiny(work / "tiny", arch="qwen3", shards=1, seed=0)
    if model == "smollm2":
        from fixtures.smollm2 import write_smollm2

        return write_smollm2(work / "smollm2", progress=False)
    if Path(model).is_dir():
        return Path(model)
    raise BenchError(f"model={model!r}: use tiny, smollm2 or a checkpoint directory")


@bench_row("daemon_weight_load", "engine weight-load phase: verified_cache hit vs auto")
def daemon_weight_load(options: BenchOptions) -> list[BenchResult]:
    from preload.promote import promote

    work = Path(tempfile.mkdtemp(prefix="pg-bench-d-", dir=options.workdir or default_workdir()))
    root = Path(tempfile.mkdtemp(prefix="pg-b-", dir="/tmp"))
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PRELOAD_GATE_EVENTS", None)
    try:
        ckpt = _checkpoint(options, work)
        promote(ckpt, socket_root=root, cache_dir=work / "cache")
        auto = _engine(ckpt, env, {})
        daemon = _Daemon(ckpt, root, env, "--stage", "loaded")
        try:
            events = work / "events.jsonl"
            cached = _engine(ckpt, dict(env, PRELOAD_GATE_EVENTS=str(events)), {
                "load_format": "verified_cache", "extra": {"socket_root": str(root), "fallback": False}})
        finally:
            daemon.stop()
        event = json.loads(events.read_text().splitlines()[0])
        if event["outcome"] != "hit" or cached["tokens"] != auto["tokens"]:
            raise BenchError(f"cached engine did not hit with identical tokens: {event}")
        ours = cached["load_s"]
        return [BenchResult(
            row="daemon_weight_load", title=f"weight-load phase ({options.param('model', 'tiny')})",
            anchor=Figure("auto", auto["load_s"], "s"), ours=Figure("verified_cache hit", ours, "s"),
            ratio=auto["load_s"] / ours if ours > 0 else None, ratio_meaning="auto / verified_cache",
            details={"event_seconds": event["seconds"], "bytes": event["bytes"], "tensors": event["tensors"],
                     "daemon_load_seconds": daemon.ready["ranks"][0]["load_seconds"]},
            notes="wall time of the model runner's get_model in each engine; same checkpoint, same run; "
                  "the cached side includes digest resolution (stat), socket, attach and CPU processing",
        )]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


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
    from preload.identity.shards import read_header, shard_paths

    return sum(t.nbytes for p in shard_paths(ckpt) for t in read_header(p).tensors)


@bench_row("daemon_peak_memory", "daemon peak memory as a multiple of weight bytes")
def daemon_peak_memory(options: BenchOptions) -> list[BenchResult]:
    from harness.bench.identity import write_synthetic

    work = Path(tempfile.mkdtemp(prefix="pg-bench-m-", dir=options.workdir or default_workdir()))
    root = Path(tempfile.mkdtemp(prefix="pg-b-", dir="/tmp"))
    env = dict(os.environ, PRELOAD_GATE_CACHE=str(work / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    size = int(options.param("size", str(256 << 20)))
    results = []
    try:
        cases = [("raw", write_synthetic(work / "synthetic", 2, size // 2, tensors_per_shard=8)[0].parent)]
        if options.param("model", ""):
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


def _run_engine(spec: dict[str, Any]) -> None:
    # The engine core in this process, so the model runner's get_model can be timed
    # (the CPU runner logs no load time of its own).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm.v1.worker.cpu_model_runner as runner
    from vllm import LLM, SamplingParams

    inner = runner.get_model

    def timed_get_model(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        model = inner(*args, **kwargs)
        print(f"PG_WEIGHT_LOAD_SECONDS {time.perf_counter() - start:.6f}", flush=True)
        return model

    runner.get_model = timed_get_model

    kwargs: dict[str, Any] = dict(model=spec["model"], load_format=spec.get("load_format", "auto"),
                                  max_model_len=256, enforce_eager=True, gpu_memory_utilization=0.1, seed=0)
    if spec.get("extra") is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    llm = LLM(**kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


if __name__ == "__main__":
    _run_engine(json.loads(sys.argv[1]))
