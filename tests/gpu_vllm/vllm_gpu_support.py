"""Helpers of the CUDA vLLM tier: engines side by side, nvidia-smi readings,
vLLM's own preload daemon, a figures file for docs/gpu.md."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from daemon_support import repo_pythonpath

from harness.engine import EngineResult, EngineSpec, run_engine
from harness.targets._procs import kill_group
from harness.targets.ipc_cache import start_vllm_preload
from preload.client import DaemonClient

FIGURES_ENV = "PRELOAD_GATE_GPU_FIGURES"
ENGINE_TIMEOUT_S = 420.0


def record(name: str, value: Any) -> None:
    """Add ``name: value`` to the figures file ($PRELOAD_GATE_GPU_FIGURES), if set."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    try:
        figures = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        figures = {}
    figures[name] = value
    Path(path).write_text(json.dumps(figures, indent=1, sort_keys=True))


# The negative controls (header-only keys, uncounted memory) are refused without it.
UNSAFE = {"PRELOAD_GATE_ALLOW_UNSAFE_CONTROLS": "1"}


def engine_env(cache: Path) -> dict[str, str]:
    return {"PRELOAD_GATE_CACHE": str(cache), "PYTHONPATH": repo_pythonpath(), **UNSAFE}


def engine_spec(cache: Path, ckpt: Path, load_format: str = "auto", extra: dict | None = None, **kw: Any) -> EngineSpec:
    """One engine of the tier: ``ckpt`` under ``load_format``, manifests read from ``cache``."""
    return EngineSpec(checkpoint=str(ckpt), load_format=load_format, extra_config=extra, env=engine_env(cache), **kw)


def run_all(specs: Mapping[str, EngineSpec], workdir: Path,
            workers: int = int(os.environ.get("PRELOAD_GATE_GPU_VLLM_WORKERS", "4"))) -> dict[str, EngineResult]:
    """Every spec in its own engine process, several at once (their starts
    take turns: harness.engine_worker's GPU start lock)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(run_engine, spec, workdir / name, ENGINE_TIMEOUT_S)
                   for name, spec in specs.items()}
        return {name: f.result() for name, f in futures.items()}


def engine_log(workdir: Path, name: str) -> str:
    return (workdir / name / "engine.log").read_text(errors="replace")


def why_failed(r: EngineResult) -> str:
    return f"{r.error}\n{r.log_tail[-3000:]}"


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_memory_mib() -> dict[str, int]:
    """GPU 0's total, used and free memory in MiB, from nvidia-smi (no CUDA context of ours)."""
    total, used, free = (int(v) for v in smi("memory.total,memory.used,memory.free")[0])
    return {"total": total, "used": used, "free": free}


def process_mib(pid: int) -> int | None:
    """Device memory nvidia-smi charges to ``pid`` (MiB), None where it lists none."""
    for row in smi("pid,used_memory", "compute-apps"):
        if row and row[0] == str(pid):
            return int(row[1])
    return None


def stats(socket_dir: Path, rank: int = 0) -> dict[str, Any]:
    client = DaemonClient.connect(socket_dir, rank, 10.0, 30.0, client="gpu-vllm-test")
    try:
        return client.stats()
    finally:
        client.close()


@contextmanager
def vllm_preload(checkpoint: Path, timeout_s: float = 600.0) -> Iterator[dict[str, Any]]:
    """vLLM's own ``vllm preload --model CKPT`` (unmodified) until the block
    ends; yields its socket dir, process and log path."""
    sockets = Path(tempfile.mkdtemp(prefix="pg-vp-", dir="/tmp"))
    log = sockets.with_suffix(".log")
    proc = start_vllm_preload(checkpoint, sockets, log, ready_timeout_s=timeout_s)
    try:
        yield {"socket_dir": sockets, "proc": proc, "log": log}
    finally:
        kill_group(proc)
