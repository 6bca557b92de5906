"""The daemon's device memory on CUDA, and an engine beside it (issue 38).

Run alone on the GPU (scripts/gpu_vllm_suite.sh step ``memory``): it reads
the GPU's free memory and chooses ``gpu_memory_utilization`` from it, so
another process starting or stopping meanwhile would move its ground.

A 2 GiB Qwen3-architecture checkpoint (``fixtures sized``). Our daemon
(platform defaults: processed, one VMM arena) must hold the weights once
(control: before torch's cache was given back it held them twice); an
engine beside it must start at a utilization only counting the daemon's
bytes once allows (controls: ``auto`` beside it, and our loader told to count
nothing, are refused by vLLM's start-up check), and get ``auto``'s KV cache;
vLLM's own daemon and ``ipc_cache`` at the same utilization, for comparison.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from daemon_support import Daemon, short_dir
from vllm_gpu_support import (
    engine_spec,
    gpu_memory_mib,
    process_mib,
    record,
    stats,
    vllm_preload,
    why_failed,
)

from harness.engine import EngineSpec, run_engine
from preload.promote import promote

pytestmark = [pytest.mark.gpu_vllm, pytest.mark.timeout(1800)]

GIB = 1 << 30


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.sized import write_sized

    return write_sized(tmp_path_factory.mktemp("sized") / "ckpt", 2 * GIB)


def test_the_daemon_holds_the_weights_once_and_an_engine_beside_it_gets_autos_kv_cache(
        sized: Path, tmp_path: Path) -> None:
    cache, work = tmp_path / "cache", tmp_path

    def spec(ckpt: Path, load_format: str = "auto", extra: dict | None = None, **kw) -> EngineSpec:
        return engine_spec(cache, ckpt, load_format, extra, **kw)

    root = short_dir("pg-gvmem-")
    promote(sized, socket_root=root, cache_dir=cache, progress=False)
    weights = sum(p.stat().st_size for p in sized.glob("*.safetensors"))
    vc = {"socket_root": str(root), "fallback": True}
    figures: dict = {"weights_bytes": weights}
    used0 = gpu_memory_mib()["used"]
    d = Daemon(sized, root, cache, args=()).start(timeout=900)
    figures["daemon_gpu_used_mib"] = gpu_memory_mib()["used"] - used0
    try:
        st = stats(d.socket_dir)
        held, arena, returned = st["device_bytes_held"], st["resident_bytes"], st["device_cache_returned"]
        figures.update(daemon_device_bytes_held=held, arena_bytes=arena, torch_cache_returned=returned,
                       daemon_nvidia_smi_mib=process_mib(d.rank_pid))
        assert held <= 1.05 * arena, figures
        # Control: before the cache was given back the daemon held the weights twice.
        assert held + returned > 1.05 * arena, figures
        # A utilization above what is free beside the daemon, below it once the daemon's bytes are counted once.
        mem = gpu_memory_mib()
        util = round((mem["free"] * (1 << 20) + arena / 2) / (mem["total"] * (1 << 20)), 4)
        figures.update(util=util, free_mib_beside_daemon=mem["free"], total_mib=mem["total"])
        ours = run_engine(spec(sized, "verified_cache", vc, gpu_memory_utilization=util), work / "m-ours")
        assert ours.ok, why_failed(ours)
        assert ours.events[0]["outcome"] == "hit", ours.events
        # Controls: auto beside the daemon, and our loader told to count nothing, both refuse to start.
        auto_beside = run_engine(spec(sized, gpu_memory_utilization=util), work / "m-auto-beside")
        uncounted = run_engine(spec(sized, "verified_cache", {**vc, "unsafe_uncounted_memory": True},
                                          gpu_memory_utilization=util), work / "m-uncounted")
        figures.update(ours=ours.vllm_figures, auto_beside_ok=auto_beside.ok, uncounted_ok=uncounted.ok)
        for refused in (auto_beside, uncounted):
            said = (refused.error or "") + refused.log_tail
            assert not refused.ok and "Free memory on device" in said, said[-2000:]
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    auto = run_engine(spec(sized, gpu_memory_utilization=util), work / "m-auto")
    assert auto.ok, why_failed(auto)
    figures["auto"] = auto.vllm_figures
    used0 = gpu_memory_mib()["used"]
    with vllm_preload(sized) as vp:
        figures["vllm_daemon_gpu_used_mib"] = gpu_memory_mib()["used"] - used0
        ipc = run_engine(spec(sized, "ipc_cache", {"socket_dir": str(vp["socket_dir"]), "fallback": True},
                                    gpu_memory_utilization=util), work / "m-ipc")
        figures.update(ipc_ok=ipc.ok, ipc=ipc.vllm_figures)
    record("memory_2g", figures)
    kv_auto, kv_ours = auto.vllm_figures["kv_cache_gib"], ours.vllm_figures["kv_cache_gib"]
    assert abs(kv_ours - kv_auto) <= max(0.02 * kv_auto, 0.05), figures
    if ipc.ok:  # where vLLM's own daemon lets an engine start, ours does (ours started above)
        assert abs(ipc.vllm_figures["kv_cache_gib"] - kv_auto) <= max(0.02 * kv_auto, 0.05), figures
